#!/bin/sh
# bootstrap: install this bundle's floor runtime (bundle-runtime) on a device that has only python3 (3.10+,
# with venv), openssl (3.0+) and coreutils. Nothing from the bundle runs before it is verified:
#   1. the DSSE envelope's Ed25519 signature over the bundle manifest, with `openssl pkeyutl -verify -rawin`
#      and the key given with --trust (the pre-authentication encoding exactly as runtime/store/trust.py builds it);
#   2. every wheel for this platform against its size and sha256 in that signed manifest (`sha256sum`),
#      on a private copy, so the stick cannot change them after the check;
#   3. only then `python3 -m venv` and `pip install --no-index` from those verified copies; a runtime
#      older than the newest one installed under PREFIX is refused unless --allow-downgrade.
#   4. the platform's own TensorRT Python bindings (JetPack's python3-libnvinfer: `tensorrt*` in the system
#      python's dist-packages), when there are any, are exposed in the runtime's venv alone: a .pth names a
#      folder of links to those packages only, so no other system package becomes importable there.
# Usage:  sh /media/usb/assistant-3/bootstrap --trust release.pub [--prefix /opt/bundle] [--verify-only]
#         [--allow-downgrade] [--no-platform-tensorrt]
# Exit codes (the bundle's own table): 0 ok, 2 usage (also a --trust file that is not an Ed25519 public key),
#   3 bad bundle, 4 untrusted, 5 refused (newer format; an older runtime without --allow-downgrade),
#   6 environment; 128+N when signal N ends it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP): the runtime being
#   installed is removed and `current` is unchanged. The work folder goes on every exit path; one that
#   SIGKILL left is removed by the next run once its process is gone.
set -eu

PREFIX=/opt/bundle
TRUST=
VERIFY_ONLY=0
ALLOW_DOWNGRADE=0
PLATFORM_TRT=1
PY=${PYTHON:-python3}
WORK=        # $TMPDIR/bundle-bootstrap-*: the verified wheel copies
CHILD=       # the long step running now (venv, pip), killed with the bootstrap
NEW_VENV=    # the runtime this run is creating: removed unless `current` names it
HELD=        # a signal that arrived while traps only record (a child's start, the switch of `current`)
die() { code=$1; shift; echo "bootstrap: error: $*" >&2; exit "$code"; }
usage() { echo "usage: sh $0 --trust KEY.pub [--prefix DIR] [--python PYTHON] [--verify-only] [--allow-downgrade] [--no-platform-tensorrt]"; }

cleanup() {  # every exit path: the unfinished runtime, the work folder (tens of MB of wheels)
  # SIGKILL: a child between fork and exec loses a catchable signal, and all it wrote is removed below anyway
  if [ -n "$CHILD" ]; then kill -s KILL "$CHILD" 2>/dev/null || :; wait "$CHILD" 2>/dev/null || :; CHILD=; fi
  if [ -n "$NEW_VENV" ] && [ "$(readlink "$PREFIX/current" 2>/dev/null || :)" != "${NEW_VENV##*/}" ]; then
    rm -rf "$NEW_VENV"
  fi
  NEW_VENV=
  if [ -n "$WORK" ]; then rm -rf "$WORK"; WORK=; fi
}
on_signal() {  # $1 name, $2 exit status. A second signal cannot cut the cleanup short.
  trap '' INT TERM HUP
  cleanup
  echo "bootstrap: stopped by $1: nothing installed, $PREFIX/current unchanged" >&2
  exit "$2"
}
arm() { trap 'on_signal SIGINT 130' INT; trap 'on_signal SIGTERM 143' TERM; trap 'on_signal SIGHUP 129' HUP; }
hold() { trap 'HELD="SIGINT 130"' INT; trap 'HELD="SIGTERM 143"' TERM; trap 'HELD="SIGHUP 129"' HUP; }
trap cleanup EXIT
arm
# A long step runs in the background: sh acts on a signal only between foreground commands, but at once in wait.
start() {
  hold  # until CHILD names it, so the trap cannot miss the child it must stop
  "$@" &
  CHILD=$!
  arm
  if [ -n "$HELD" ]; then on_signal $HELD; fi
}
finish() { wait "$CHILD" && rc=0 || rc=$?; CHILD=; return "$rc"; }
run() { start "$@"; finish; }
pause() {  # test hook: BUNDLE_PAUSE_AT=STAGE:SECONDS waits at STAGE (verified, venv, pip, installed) for a signal
  case ${BUNDLE_PAUSE_AT:-} in
    "$1":*) secs=${BUNDLE_PAUSE_AT#*:}
            case $secs in ''|*[!0-9]*) die 2 "BUNDLE_PAUSE_AT=$BUNDLE_PAUSE_AT: expected STAGE:SECONDS" ;; esac
            start sleep "$secs"; echo "bootstrap: paused at $1" >&2; finish ;;
  esac
}

while [ $# -gt 0 ]; do
  case $1 in
    --trust) [ $# -ge 2 ] || die 2 "--trust needs a public key file"; TRUST=$2; shift 2 ;;
    --prefix) [ $# -ge 2 ] || die 2 "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
    --python) [ $# -ge 2 ] || die 2 "--python needs an interpreter"; PY=$2; shift 2 ;;
    --verify-only) VERIFY_ONLY=1; shift ;;
    --allow-downgrade) ALLOW_DOWNGRADE=1; shift ;;
    --no-platform-tensorrt) PLATFORM_TRT=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die 2 "unknown argument: $1" ;;
  esac
done
[ -n "$TRUST" ] || { usage >&2; die 2 "expected --trust KEY.pub (the release public key), found none"; }
[ -e "$TRUST" ] || die 2 "expected a public key file at $TRUST, found none"
BUNDLE=$(cd "$(dirname "$0")" && pwd -P)
SELF=$BUNDLE/$(basename "$0")

command -v openssl >/dev/null 2>&1 || die 6 "openssl not found: expected OpenSSL 3.0+ on PATH (apt install openssl)"
command -v sha256sum >/dev/null 2>&1 || die 6 "sha256sum not found: expected GNU coreutils"
command -v "$PY" >/dev/null 2>&1 || die 6 "$PY not found: expected Python 3.10+ with venv"
"$PY" -I -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null \
  || die 6 "expected Python 3.10+, found $("$PY" -V 2>&1)"
"$PY" -I -c 'import venv, ensurepip' 2>/dev/null \
  || die 6 "$PY has no venv/ensurepip: expected the venv module (apt install python3-venv)"

# What an earlier run killed by SIGKILL left (its process is gone), then this run's own work folder.
for old in "${TMPDIR:-/tmp}"/bundle-bootstrap-*; do
  [ -d "$old" ] && [ ! -L "$old" ] && [ -O "$old" ] || continue
  pid=
  read -r pid 2>/dev/null < "$old/.owner-pid" || :
  case $pid in ''|*[!0-9]*) continue ;; esac
  [ -d "/proc/$pid" ] || rm -rf "$old"
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bundle-bootstrap-XXXXXX")
echo "$$" > "$WORK/.owner-pid"
# Every child's temporary files (venv's ensurepip, pip's build and unpack folders) go inside it, so a pip
# killed with the bootstrap leaves nothing behind in TMPDIR either.
mkdir "$WORK/tmp"
TMPDIR=$WORK/tmp
export TMPDIR
HELPER=$WORK/helper.py
cat > "$HELPER" <<'PY'
"""Reads (bounded; through no link, but for the operator's own --trust key) and writes files for the shell;
decides nothing about trust: openssl does."""
import base64, hashlib, json, os, platform, re, signal, stat, sys

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the shell's trap reports it and cleans up, no traceback

MANIFEST_TYPE = "application/vnd.bundle.manifest.v1+json"
ENVELOPE_TYPE = "application/vnd.dsse.envelope.v1+json"
OCI_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
FORMAT_VERSION = 2
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# The one rule for a wheel's path in the signed manifest, the same as manifests.schema.WHEEL_PATH (a test keeps
# the two equal): a file name directly under wheelhouse/, so never a folder, a '..' or a newline.
WHEEL_PATH = re.compile(r"wheelhouse/[A-Za-z0-9_.+!-]{1,251}\.whl")
KEY_LIMIT = 64 * 1024
SPKI_ED25519 = bytes.fromhex("302a300506032b6570032100")


def die(code, msg):
    print(f"bootstrap: error: {msg}", file=sys.stderr)
    sys.exit(code)


def read(path, limit, what):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        die(3, f"{what} is missing: expected {path}")
    except OSError as e:
        die(3, f"cannot open {what} {path}: {e.strerror}")
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            die(3, f"expected {what} {path} to be a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        die(3, f"{what} {path} is larger than {limit} bytes")
    return data


def blob(bundle, desc, what, limit):
    if not isinstance(desc, dict) or not isinstance(desc.get("digest"), str) or not DIGEST.match(desc["digest"]):
        die(3, f"{what}: expected a descriptor with digest 'sha256:<64 hex>'")
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= limit:
        die(3, f"{what}: expected a size of at most {limit} bytes, found {size!r}")
    data = read(os.path.join(bundle, "blobs", "sha256", desc["digest"][7:]), size, what)
    if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != desc["digest"]:
        die(3, f"{what} blob is truncated or corrupt: its size or sha256 differs from the OCI descriptor")
    return data


def loads(data, what):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        die(3, f"{what} is not valid UTF-8 JSON")


def key(path, out):
    """Normalise a PEM or OpenSSH Ed25519 public key to PEM for openssl; print its key id.

    Like runtime/store/trust.py: the key is the operator's own file, so a symbolic link to it is followed (bundle
    content never is); anything but a regular file holding such a key is exit 2, as a usage error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        die(2, f"cannot read public key {path}: {e.strerror}")
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            die(2, f"{path}: expected a PEM or OpenSSH Ed25519 public key in a regular file, found a "
                   f"{'directory' if stat.S_ISDIR(os.fstat(f.fileno()).st_mode) else 'FIFO or device'}")
        data = f.read(KEY_LIMIT + 1)
    if len(data) > KEY_LIMIT:
        die(2, f"{path}: expected a PEM or OpenSSH Ed25519 public key of a few hundred bytes, found a larger file")
    text = data.decode("ascii", "replace").strip()
    try:
        if text.startswith("ssh-ed25519 "):
            wire = base64.b64decode(text.split()[1], validate=True)
            raw = wire[-32:]
            ok = wire[:15] == b"\x00\x00\x00\x0bssh-ed25519" and wire[15:19] == b"\x00\x00\x00\x20" and len(wire) == 51
        else:
            body = "".join(ln for ln in text.splitlines() if ln and not ln.startswith("-----"))
            der = base64.b64decode(body, validate=True)
            ok = text.startswith("-----BEGIN PUBLIC KEY-----") and len(der) == 44 and der[:12] == SPKI_ED25519
            raw = der[12:]
    except (ValueError, IndexError):
        ok = False
    if not ok:
        die(2, f"{path}: expected a PEM or OpenSSH Ed25519 public key")
    pem = base64.b64encode(SPKI_ED25519 + raw).decode()
    with open(out, "w") as f:
        f.write(f"-----BEGIN PUBLIC KEY-----\n{pem}\n-----END PUBLIC KEY-----\n")
    print(hashlib.sha256(raw).hexdigest())


def extract(bundle, work):
    """Envelope -> pae.bin, sig.N, manifest.json (the signed bytes); prints the number of signatures."""
    if not os.path.isfile(os.path.join(bundle, "COMPLETE")):
        die(3, f"incomplete bundle: {bundle}/COMPLETE is missing (interrupted create or copy)")
    index = loads(read(os.path.join(bundle, "index.json"), 1 << 20, "index.json"), "index.json")
    chosen = [m for m in (index.get("manifests") or []) if isinstance(m, dict)
              and m.get("mediaType") == OCI_MANIFEST_TYPE] if isinstance(index, dict) else []
    if len(chosen) != 1:
        die(3, f"index.json: expected exactly one OCI image manifest, found {len(chosen)}")
    oci = loads(blob(bundle, chosen[0], "OCI manifest", 16 << 20), "OCI manifest")
    if not isinstance(oci, dict) or not isinstance(oci.get("config"), dict) \
            or oci["config"].get("mediaType") != MANIFEST_TYPE or not isinstance(oci.get("layers"), list):
        die(3, f"OCI manifest: expected a config of mediaType {MANIFEST_TYPE} and a layers list")
    config = blob(bundle, oci["config"], "bundle manifest", 8 << 20)
    envelopes = [d for d in oci["layers"] if isinstance(d, dict) and d.get("mediaType") == ENVELOPE_TYPE]
    if not envelopes:
        die(4, "bundle is unsigned (no signature envelope): expected a signature by the --trust key")
    if len(envelopes) > 1:
        die(3, f"OCI manifest: expected one signature envelope, found {len(envelopes)}")
    env = loads(blob(bundle, envelopes[0], "signature envelope", (16 << 20) + (64 << 10)), "signature envelope")
    try:
        ptype, payload = env["payloadType"], base64.b64decode(env["payload"], validate=True)
        sigs = [base64.b64decode(s["sig"], validate=True) for s in env.get("signatures", [])][:64]
    except (KeyError, TypeError, ValueError):
        die(3, "signature envelope: expected DSSE fields payloadType, payload, signatures (base64)")
    if ptype != MANIFEST_TYPE:
        die(4, f"signature envelope: expected payloadType {MANIFEST_TYPE!r}, found {ptype!r}")
    if not sigs:
        die(4, "bundle is unsigned (no signatures): expected a signature by the --trust key")
    if payload != config:
        die(4, "the signed manifest differs from the bundle manifest blob: expected the signature to cover it")
    t = ptype.encode()
    pae = b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)  # runtime/store/trust.py: manifests.layout.pae
    with open(os.path.join(work, "pae.bin"), "wb") as f:
        f.write(pae)
    with open(os.path.join(work, "manifest.json"), "wb") as f:
        f.write(payload)
    for i, s in enumerate(sigs):
        with open(os.path.join(work, f"sig.{i}"), "wb") as f:
            f.write(s)
    print(len(sigs), " ".join(str(s.get("keyid", ""))[:16] for s in env.get("signatures", [])[:64]
                              if isinstance(s, dict)))


def wheels(work, bundle, self_path):
    """From the VERIFIED manifest: copy this platform's wheels, write SHA256SUMS and SIZES, print the plan."""
    m = loads(read(os.path.join(work, "manifest.json"), 8 << 20, "manifest"), "manifest")
    fv = m.get("format_version") if isinstance(m, dict) else None
    if not isinstance(fv, int):
        die(3, "signed manifest: expected an integer format_version")
    if fv > FORMAT_VERSION:
        die(5, f"bundle format_version {fv} is newer than this bootstrap reads (expected <= {FORMAT_VERSION})")
    rt = m.get("runtime")
    if not isinstance(rt, dict):
        die(2, "this bundle carries no runtime: expected one made with `bundle create --with-runtime PLATFORM`")
    files = {f.get("path"): f for f in m.get("files", []) if isinstance(f, dict)}
    plat = f"linux_{platform.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}"
    paths = (rt.get("platforms") or {}).get(plat)
    if not paths:
        have = ", ".join(sorted(rt.get("platforms") or {})) or "none"
        die(6, f"this bundle's runtime is for {have}, expected one for this device ({plat})")
    own = files.get(rt.get("bootstrap"))
    if own is not None:
        mine = read(self_path, 1 << 20, "bootstrap")
        if hashlib.sha256(mine).hexdigest() != own.get("sha256"):
            die(3, f"{self_path} differs from the signed bootstrap: use the bootstrap of this same bundle")
    out = os.path.join(work, "wheels")
    os.mkdir(out)
    sums, sizes, total = [], [], 0
    for p in paths:
        if not isinstance(p, str) or not WHEEL_PATH.fullmatch(p):
            die(3, f"signed manifest: expected wheel paths like wheelhouse/NAME.whl, found {p!r}")
        f = files.get(p)
        name = p[len("wheelhouse/"):]
        parts = f.get("parts") if isinstance(f, dict) else None
        if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict) \
                or parts[0].get("compression") != "none":
            die(3, f"signed manifest: expected {p} to be one stored wheel")
        size, sha = f.get("size"), f.get("sha256")
        if not isinstance(size, int) or not isinstance(sha, str) or not re.match(r"^[0-9a-f]{64}$", sha):
            die(3, f"signed manifest: expected a size and sha256 for {p}")
        data_path = os.path.join(bundle, "blobs", "sha256", parts[0]["digest"][7:] if DIGEST.match(
            str(parts[0].get("digest"))) else "-")
        try:
            fd = os.open(data_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            die(3, f"{p}: its blob is missing: expected {data_path}")
        with os.fdopen(fd, "rb") as src, open(os.path.join(out, name), "wb") as dst:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                die(3, f"{p}: expected its blob to be a regular file")
            left = size + 1  # one byte more than signed: a longer blob shows as a size mismatch
            while left > 0:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    break
                dst.write(chunk)
                left -= len(chunk)
        sums.append(f"{sha}  {name}\n")
        sizes.append(f"{size} {name}\n")
        total += size
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        f.writelines(sums)
    with open(os.path.join(work, "SIZES"), "w") as f:
        f.writelines(sizes)
    digest = hashlib.sha256("".join(sorted(sums)).encode()).hexdigest()[:12]
    print(rt.get("package"), rt.get("version"), plat, len(paths), total, digest)


def _version_key(text):
    """A PEP 440 version (release, a/b/rc, .post, .dev; a +local part is ignored) as a sortable tuple."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)(?:[-_.]?(a|b|rc)[-_.]?(\d*))?(?:[-_.]?(post)[-_.]?(\d*))?"
                     r"(?:[-_.]?(dev)[-_.]?(\d*))?(?:\+[a-z0-9.]+)?", str(text).strip().lower())
    if m is None:
        return None
    release = [int(x) for x in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = ({"a": 0, "b": 1, "rc": 2}[m.group(2)], int(m.group(3) or 0)) if m.group(2) else \
        ((-1, 0) if m.group(6) and not m.group(4) else (3, 0))  # X.devN sorts before X's pre-releases
    post = int(m.group(5) or 0) if m.group(4) else -1
    dev = int(m.group(7) or 0) if m.group(6) else float("inf")
    return tuple(release), pre, post, dev


def downgrade(prefix, package, version):
    """`older NEWEST` when `version` is below the newest runtime of `package` installed under prefix,
    `unordered OTHER` when it cannot be ordered against one of them (not PEP 440), nothing otherwise."""
    newest = None
    try:
        names = sorted(n for n in os.listdir(prefix) if n.startswith("runtime-"))
    except OSError:
        names = []
    for n in names:
        marker = os.path.join(prefix, n, ".bootstrap-complete")
        try:
            fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            fields = f.read(4096).decode("utf-8", "replace").split() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) \
                else []
        if len(fields) < 2 or fields[0] != package:
            continue
        have = _version_key(fields[1])
        if have is None or _version_key(version) is None:
            print("unordered", fields[1])
            return
        if newest is None or have > newest[0]:
            newest = (have, fields[1])
    if newest is not None and _version_key(version) < newest[0]:
        print("older", newest[1])


PLATFORM_DIR = "platform-packages"  # in the venv: links to the platform's tensorrt* packages, nothing else
PLATFORM_PTH = "bundle-platform-tensorrt.pth"
PLATFORM_NAME = re.compile(r"^tensorrt(?:[_.-].*)?$", re.IGNORECASE)  # tensorrt, tensorrt_lean, tensorrt-10...dist-info


def platform_tensorrt(venv, enabled):
    """Run by the system python: link its `tensorrt*` packages (and their metadata) into VENV/platform-packages
    and name that folder in a .pth of the venv's site-packages; print the folder they came from, or nothing.
    The links are rebuilt on every run (an apt upgrade of TensorRT is picked up by the next bootstrap)."""
    import glob, importlib.util, shutil
    sites = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    if len(sites) != 1:
        die(6, f"expected one site-packages in {venv}, found {len(sites)}")
    links, pth = os.path.join(venv, PLATFORM_DIR), os.path.join(sites[0], PLATFORM_PTH)
    for old in (pth, links + ".new"):
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        elif os.path.lexists(old):
            os.unlink(old)
    spec = importlib.util.find_spec("tensorrt") if enabled == "1" else None
    if spec is None or not spec.submodule_search_locations:
        if os.path.isdir(links):
            shutil.rmtree(links)
        return
    source = os.path.dirname(os.path.realpath(list(spec.submodule_search_locations)[0]))
    os.mkdir(links + ".new")
    for name in sorted(os.listdir(source)):
        if PLATFORM_NAME.match(name):
            os.symlink(os.path.join(source, name), os.path.join(links + ".new", name))
    if os.path.isdir(links):
        shutil.rmtree(links)
    os.rename(links + ".new", links)
    with open(pth, "w") as f:
        f.write(links + "\n")
    print(source)


try:
    {"key": key, "extract": extract, "wheels": wheels, "downgrade": downgrade,
     "platform-tensorrt": platform_tensorrt}[sys.argv[1]](*sys.argv[2:])
except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:  # malformed content: one line
    die(3, f"unexpected bundle content ({type(e).__name__}: {str(e)[:200]})")
PY

# 0. can this openssl verify Ed25519 at all? (a known signature; OpenSSL 1.1 has no -rawin)
"$PY" -I - "$WORK" <<'PY'
import base64, sys
w = sys.argv[1]
open(f"{w}/kat.pem", "w").write("-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(bytes.fromhex(
    "302a300506032b6570032100") + base64.b64decode("oVus0lf3YKwNFUusNUXC/yGtJmFL/8NR4c3SJY2/Mrs=")).decode()
    + "\n-----END PUBLIC KEY-----\n")
open(f"{w}/kat.msg", "wb").write(b"bundle bootstrap: can this openssl verify Ed25519?")
open(f"{w}/kat.sig", "wb").write(base64.b64decode(
    "0kdtVIrmSNCaddxZ0LG8G2aZBb4+sFP0lKh5tl4kjTpaNMR3/dghJ7R/6OLtMTgMJ2oRqsQTq7zbdUAl2XULAQ=="))
PY
openssl pkeyutl -verify -rawin -pubin -inkey "$WORK/kat.pem" -in "$WORK/kat.msg" -sigfile "$WORK/kat.sig" \
  >/dev/null 2>&1 || die 6 "this openssl ($(openssl version 2>&1 | head -n 1)) cannot verify Ed25519 signatures: expected OpenSSL 3.0+ with Ed25519"

# 1. the signature
KEYID=$("$PY" -I "$HELPER" key "$TRUST" "$WORK/trust.pem") || exit $?
out=$("$PY" -I "$HELPER" extract "$BUNDLE" "$WORK") || exit $?
set -- $out
NSIG=$1; shift; CLAIMED=$*
ok=0; i=0
while [ "$i" -lt "$NSIG" ]; do
  if openssl pkeyutl -verify -rawin -pubin -inkey "$WORK/trust.pem" -in "$WORK/pae.bin" \
      -sigfile "$WORK/sig.$i" >/dev/null 2>&1; then ok=1; break; fi
  i=$((i + 1))
done
[ "$ok" = 1 ] || die 4 "no signature verifies with $TRUST (key id $(echo "$KEYID" | cut -c1-16)); the bundle claims signer(s) ${CLAIMED:-none}: expected a bundle signed by that key, unaltered"
echo "bootstrap: signature OK (key id $(echo "$KEYID" | cut -c1-16))"

# 2. the wheels, from the signed manifest only
out=$("$PY" -I "$HELPER" wheels "$WORK" "$BUNDLE" "$SELF") || exit $?
set -- $out
PACKAGE=$1; VERSION=$2; PLATFORM=$3; NWHEELS=$4; TOTAL=$5; HOUSE=$6
while read -r size name; do
  actual=$(wc -c < "$WORK/wheels/$name" | tr -d ' ')
  [ "$actual" -eq "$size" ] || die 3 "wheelhouse/$name is $actual bytes, the signed manifest says $size: copy the bundle again"
done < "$WORK/SIZES"
( cd "$WORK/wheels" && sha256sum --check --strict --quiet SHA256SUMS >/dev/null 2>&1 ) || {
  bad=$(cd "$WORK/wheels" && sha256sum --check --strict SHA256SUMS 2>/dev/null | grep -v ': OK$' | head -n 1)
  die 3 "a wheel differs from its signed sha256 (${bad:-unknown}): copy the bundle again"
}
echo "bootstrap: $NWHEELS wheels for $PLATFORM OK ($TOTAL bytes, sha256 as signed)"
pause verified
if [ "$VERIFY_ONLY" = 1 ]; then echo "bootstrap: verified (--verify-only: nothing installed)"; exit 0; fi

# 3. install from the verified copies: a fresh venv per runtime content, then switch `current`
out=$("$PY" -I "$HELPER" downgrade "$PREFIX" "$PACKAGE" "$VERSION") || exit $?
set -- $out
if [ $# -eq 2 ]; then  # the store's rule for models, for the runtime: never down unless asked
  if [ "$1" = older ]; then why="is older than $2 installed in $PREFIX: expected $2 or newer"
  else why="cannot be ordered against $2 installed in $PREFIX: expected PEP 440 versions"; fi
  [ "$ALLOW_DOWNGRADE" = 1 ] || die 5 "runtime $PACKAGE $VERSION $why (pass --allow-downgrade to install it anyway)"
  echo "bootstrap: warning: runtime $PACKAGE $VERSION $why; installing it (--allow-downgrade)" >&2
fi
VENV=$PREFIX/runtime-$VERSION-$HOUSE
mkdir -p "$PREFIX" || die 6 "cannot create $PREFIX"
if [ ! -f "$VENV/.bootstrap-complete" ]; then
  NEW_VENV=$VENV
  rm -rf "$VENV"
  run "$PY" -I -m venv "$VENV" >/dev/null || die 6 "python3 -m venv $VENV failed"
  pause venv
  # -I and --isolated: no PYTHON*/PIP_* variable and no pip.conf (PIP_CONFIG_FILE=/dev/null skips them all)
  # can add code or another wheel source; the only source is the verified copies.
  PIP_CONFIG_FILE=/dev/null
  export PIP_CONFIG_FILE
  run "$VENV/bin/python" -I -m pip --isolated install --no-index --no-cache-dir \
      --disable-pip-version-check --no-input -q --find-links "$WORK/wheels" "$WORK"/wheels/*.whl \
    || die 6 "pip could not install $PACKAGE $VERSION from the verified wheels (see above)"
  # onnxruntime-gpu (carried with --extra-wheels for a DGX Spark) and the CPU onnxruntime the runtime requires
  # share the `onnxruntime` package: installed again alone, the GPU build's files are the ones that stay.
  for gpu in "$WORK"/wheels/onnxruntime_gpu-*.whl; do
    [ -f "$gpu" ] || continue
    run "$VENV/bin/python" -I -m pip --isolated install --no-index --no-cache-dir --disable-pip-version-check \
        --no-input -q --no-deps --force-reinstall "$gpu" \
      || die 6 "pip could not install ${gpu##*/} over the CPU onnxruntime (see above)"
    echo "bootstrap: ${gpu##*/} installed over the CPU onnxruntime: its CUDA provider is the fallback without TensorRT"
  done
  pause pip
  echo "$PACKAGE $VERSION $PLATFORM $HOUSE" > "$VENV/.bootstrap-complete"
  pause installed
fi
# 4. the platform's TensorRT (JetPack: python3-libnvinfer), and nothing else of the system's packages
TRT_FROM=$("$PY" -I "$HELPER" platform-tensorrt "$VENV" "$PLATFORM_TRT") || die 6 "could not link the platform's TensorRT into $VENV"
rm -f "$VENV/.platform-tensorrt"
if [ "$PLATFORM_TRT" = 0 ]; then
  echo "bootstrap: platform TensorRT not linked (--no-platform-tensorrt): TensorRT targets serve with ONNX Runtime"
elif [ -z "$TRT_FROM" ]; then
  echo "bootstrap: no platform TensorRT for $("$PY" -V 2>&1) (python3-libnvinfer on JetPack): TensorRT targets serve with ONNX Runtime"
elif TRT_VERSION=$("$VENV/bin/python" -I -c 'import tensorrt; print(tensorrt.__version__)' 2>"$WORK/trt.err"); then
  echo "tensorrt $TRT_VERSION $TRT_FROM" > "$VENV/.platform-tensorrt"
  echo "bootstrap: platform TensorRT $TRT_VERSION from $TRT_FROM is importable in the runtime (only its tensorrt* packages)"
else
  "$PY" -I "$HELPER" platform-tensorrt "$VENV" 0 >/dev/null || :
  echo "bootstrap: warning: the platform TensorRT in $TRT_FROM does not import in the runtime ($(tail -n 1 "$WORK/trt.err")): TensorRT targets serve with ONNX Runtime" >&2
fi
# The switch: a signal from here on waits for it (the runtime is complete), then the run ends as installed.
hold
mkdir -p "$PREFIX/bin"
ln -sfn "$(basename "$VENV")" "$PREFIX/.current-new" && mv -T "$PREFIX/.current-new" "$PREFIX/current"
NEW_VENV=
ln -sfn ../current/bin/bundle "$PREFIX/bin/.bundle-new" && mv -T "$PREFIX/bin/.bundle-new" "$PREFIX/bin/bundle"
[ -z "$HELD" ] || echo "bootstrap: ${HELD% *} arrived after $PREFIX/current was switched: the install is complete" >&2
echo "bootstrap: installed $PACKAGE $VERSION at $VENV ($PREFIX/current)"
echo "next:  $PREFIX/bin/bundle install $BUNDLE --trust $TRUST --store /data/store"
