"""`bundle create` as a library call: model folders -> files to pack -> a signed bundle.

Models arrive already turned into local folders plus where they came from (`ModelInput`):
`local_model()` for a folder on this host, `demo_models()` for the embedded demo pair, and
`resolve_inputs()` for any reference (hub references through bundler.resolve). Per-target engine files
(ONNX, build options) plug in through the `target_files` hook, so engines never edit this module.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Mapping, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bundler.pack.pack import DEFAULT_MAX_PART_SIZE, PackFile, PackOptions, pack_bundle
from bundler.resolve.provenance import local_source
from manifests.errors import ResolveError, UsageError
from manifests.layout import BLOBS_DIR
from manifests.schema import Builder, FileEntry, Manifest, Model, ModelSource, Speculative, Target, format_time
from manifests.sizes import format_size
from runtime.fsutil import file_sha256

log = logging.getLogger(__name__)  # progress lines (bundler.pack.progress)

#: serve default for max_model_len: the model's own limit, capped so a small device does not run out of KV cache
MAX_MODEL_LEN_CAP = 4096
MODELS_ROOT = "models"


@dataclass(frozen=True)
class ModelInput:
    """A checkpoint ready to pack: a local folder, its role, and where it came from (pinned)."""

    role: str  # "target" | "draft"
    local_dir: Path
    source: ModelSource  # revision None for local folders: filled with a content digest after hashing
    name: str | None = None
    #: exactly the files to pack (relative POSIX paths), as the resolver chose them; None: the whole folder
    files: tuple[str, ...] | None = None
    #: path -> (size, sha256) the resolver already checked, so nothing is hashed twice
    digests: Mapping[str, tuple[int, str]] | None = None
    #: the resolver's check of what pack hashed ({path: (size, sha256)} of every file, packed or left out)
    #: against the digests the hub or the lock declares; raises to fail the create before it is finished
    check: Callable[[Mapping[str, tuple[int, str]]], object] | None = None

    @property
    def root(self) -> str:
        return f"{MODELS_ROOT}/{self.role}"


#: hook(models, targets, work_dir) -> (extra files to pack, targets with their engines filled in)
TargetFilesHook = Callable[[Sequence[ModelInput], Sequence[Target], Path], tuple[list[PackFile], list[Target]]]


# --- model inputs ----------------------------------------------------------------------------

def local_model(path: Path, role: str, *, source_type: str = "local") -> ModelInput:
    path = Path(path)
    if not path.is_dir():
        what = "nothing" if not path.exists() else "a file"
        raise UsageError(f"expected --{'model' if role == 'target' else 'draft'} {path} to be a model "
                         f"directory, found {what}")
    resolved = path.resolve()
    return ModelInput(role=role, local_dir=resolved, name=resolved.name,
                      source=local_source(resolved, None, source_type))


def demo_models() -> tuple[ModelInput, ModelInput]:
    """The embedded demo pair (bundler.demo), used when --model is not given."""
    try:
        from bundler import demo
        target_dir, draft_dir = Path(demo.DEMO_TARGET_DIR), Path(demo.DEMO_DRAFT_DIR)
    except (ImportError, AttributeError):
        raise UsageError("expected --model DIR (the embedded demo pair is not part of this install)") from None
    for d in (target_dir, draft_dir):
        if not (d / "config.json").is_file():
            raise UsageError(f"expected --model DIR (the embedded demo pair is not built: no {d / 'config.json'})")
    return (local_model(target_dir, "target", source_type="embedded"),
            local_model(draft_dir, "draft", source_type="embedded"))


def resolve_inputs(model_ref: str | None, draft_ref: str | None, *, targets: Sequence[str],
                   include: Sequence[str] = (), exclude: Sequence[str] = (), lock_path: Path | None = None,
                   max_model_len: int | None = None, force: bool = False, allow_no_chat_template: bool = False,
                   cache_dir: Path | None = None,
                   demo_draft: bool = True, eagle3_head: bool = False,
                   quantization=None) -> tuple[ModelInput, ModelInput | None, dict]:
    """Turn what the user typed into pinned, verified local files, refusing early what cannot work.

    Hub references, local folders and the embedded demo pair all go through bundler.resolve.checkpoint, so every
    model gets the same file filter, digests, lock-file checks and pre-flight checks (architecture,
    draft tokenizer, memory fit per target) before any weights are downloaded.
    `eagle3_head`: the draft is an EAGLE-3 head (pinned and locked like a draft; its pre-flight check is
    the head's: config against the target's hidden size, vocabulary and layers, not a tokenizer).
    `quantization` (manifests.quantization.QuantizeOptions): the memory check counts 4-bit weights where given.
    """
    from bundler.model_config import read_config
    from bundler.resolve.checks import run_preflight_checks
    from bundler.resolve.lockfile import read_lock, refs_from_lock
    from bundler.resolve.checkpoint import resolve_models
    from runtime.profiles import get_profile

    embedded = False
    if model_ref is None and lock_path is not None:
        refs = refs_from_lock(read_lock(lock_path))
        model_ref, draft_ref = refs["target"], draft_ref or refs.get("draft")
    if model_ref is None:
        if draft_ref is not None:
            raise UsageError("expected --model together with --draft, found only --draft")
        target, draft = demo_models()
        model_ref, embedded = str(target.local_dir), True
        draft_ref = str(draft.local_dir) if demo_draft else None
    from manifests.quantization import with_quantization
    profiles = [with_quantization(get_profile(t), quantization) for t in targets]

    def preflight(plans):
        length = max_model_len
        if length is None:
            cfg = read_config(plans["target"].local_dir, plans["target"].name)
            length = min(int(cfg.get("max_position_embeddings") or MAX_MODEL_LEN_CAP), MAX_MODEL_LEN_CAP)
        if eagle3_head and "draft" in plans:
            check_head_config(plans["draft"].local_dir, plans["target"].local_dir, plans["draft"].name,
                              plans["target"].name)
            plans = {"target": plans["target"]}
        run_preflight_checks(plans, profiles, length, force=force, allow_no_chat_template=allow_no_chat_template)

    log.info("resolve: %s%s for %s", model_ref, f" with draft {draft_ref}" if draft_ref else "", ", ".join(targets))
    resolved = resolve_models(model_ref, draft_ref, include=include, exclude=exclude, lock_path=lock_path,
                              cache_dir=cache_dir, preflight=preflight, hash_files=False)
    for r in resolved.values():
        log.info("resolve: %s %s @ %s: %d files, %s", r.role, r.name, r.source.revision or "(hashed when packed)",
                 len(r.files), format_size(sum(f.size for f in r.files)))
    inputs = {role: input_from_resolved(r, embedded=embedded) for role, r in resolved.items()}
    return inputs["target"], inputs.get("draft"), resolved


def input_from_resolved(r, *, embedded: bool = False) -> ModelInput:
    """A bundler.resolve.checkpoint.ResolvedModel as pack's input: files it hashed are reused, the others are hashed
    by pack while it compresses and checked (bundler.resolve.checkpoint.check_packed) before the bundle is finished."""
    from bundler.resolve.checkpoint import check_packed

    source = local_source(r.local_dir, r.source.revision, "embedded") if embedded else r.source
    return ModelInput(role=r.role, local_dir=Path(r.local_dir), source=source, name=r.name,
                      files=tuple(f.path for f in r.files),
                      digests={f.path: (f.size, f.sha256) for f in r.files if f.checked},
                      check=None if all(f.checked for f in r.files) else (lambda found: check_packed(r, found)))


def checked_resolution(resolved: Mapping[str, object], manifest: Manifest) -> dict:
    """The resolved models with every digest as packed (what the lock file records), checked again."""
    from bundler.resolve.checkpoint import check_packed

    out = {}
    for role, r in resolved.items():
        m = next((m for m in manifest.models if m.role == role), None)
        out[role] = r if m is None else check_packed(r, packed_digests(manifest, m.root, m.extra))
    return out


def packed_digests(manifest: Manifest, root: str, extra: Mapping) -> dict[str, tuple[int, str]]:
    """{path under the model folder: (size, sha256)} of one model, packed or left out (omitted_files)."""
    prefix = root.rstrip("/") + "/"
    found = {e.path[len(prefix):]: (e.size, e.sha256) for e in manifest.files if e.path.startswith(prefix)}
    found.update({o["path"]: (o["size"], o["sha256"]) for o in extra.get("omitted_files", ())})
    return found


def check_head_config(head_dir: Path, target_dir: Path, head_name: str, target_name: str) -> list[int]:
    """Pre-flight (config.json only, before the head's weights are fetched): the head's layer ids for
    this target, or ModelError naming the mismatch (hidden size, vocabulary, layer ids)."""
    from bundler.onnx import eagle3
    from bundler.model_config import read_config

    cfg = eagle3.read_head_config(Path(head_dir))
    return eagle3.check_against_target(cfg, read_config(Path(target_dir), target_name),
                                       f"EAGLE-3 head {head_name} for {target_name}")


def eagle3_head_input(head: ModelInput | None, target: ModelInput) -> tuple[ModelInput, list[int]]:
    """The EAGLE-3 head to pack as the bundle's draft (resolved like a draft by resolve_inputs; None: the
    demo head), checked against the target (hidden size, vocabulary, layer ids, and with its weights the
    d2t/t2d map): (input, the target layers whose hidden states it reads)."""
    from bundler.onnx import eagle3
    if head is None:
        from bundler import demo
        head = local_model(Path(demo.DEMO_EAGLE3_DIR), "draft", source_type="embedded")
    ids = check_head_config(head.local_dir, target.local_dir, head.name, target.name)
    eagle3.load_head(head.local_dir)  # the weights match the layout, d2t / t2d map one-to-one
    return head, ids


def model_files(model: ModelInput) -> list[PackFile]:
    """The resolver's file list when there is one; else every regular file under the folder,
    hidden ones skipped, symlinks to files followed (Hugging Face cache snapshots are symlinks)."""
    base = model.local_dir
    if model.files is not None:
        return [PackFile(src=base / rel, path=f"{model.root}/{rel}", sha256=_known_sha256(model, rel, base / rel))
                for rel in model.files]
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise UsageError(f"expected plain folders in model {base}, found a symlinked folder "
                                 f"{os.path.join(dirpath, d)}")
        for fname in sorted(filenames):
            if fname.startswith("."):
                continue
            full = Path(dirpath) / fname
            if full.is_symlink() and not full.exists():
                raise UsageError(f"expected {full} to point to a file, found a broken symlink")
            if not full.is_file():
                continue  # sockets, fifos, devices: not model content
            rel = full.relative_to(base).as_posix()
            out.append(PackFile(src=full, path=f"{model.root}/{rel}", sha256=_known_sha256(model, rel, full)))
    if not out:
        raise UsageError(f"expected model files in {base}, found none")
    return out


def _known_sha256(model: ModelInput, rel: str, src: Path) -> str | None:
    """The digest the resolver computed (and checked) for this file in this run, so pack does not hash
    it again; None when there is none. A file whose size changed since is refused, not re-read."""
    known = (model.digests or {}).get(rel)
    if known is None:
        return None
    size, sha = known
    found = src.stat().st_size
    if found != size:
        raise UsageError(f"{src} changed after it was resolved: expected {size} bytes, found {found}")
    return sha


def _read_config(model: ModelInput) -> dict:
    """config.json of a model folder ({} when it has none: a bundle may carry any folder of files)."""
    from bundler.model_config import read_config

    return read_config(model.local_dir, model.name) if (model.local_dir / "config.json").is_file() else {}


def content_digest(entries: Sequence[FileEntry], root: str, omitted: Sequence[Mapping] = ()) -> str:
    """A folder's revision when it has no commit: sha256 over its sorted "path\\0size\\0sha256" lines.

    Same formula as bundler.resolve.checkpoint.content_digest, so a folder gets one revision whichever path pinned it;
    files left out of the bundle (`omitted`, the model's omitted_files) count, so leaving them out keeps it.
    """
    from bundler.resolve.checkpoint import ResolvedFile
    from bundler.resolve.checkpoint import content_digest as folder_digest

    prefix = root.rstrip("/") + "/"
    return folder_digest([ResolvedFile(e.path[len(prefix):], e.size, e.sha256)
                          for e in entries if e.path.startswith(prefix)]
                         + [ResolvedFile(o["path"], o["size"], o["sha256"]) for o in omitted])


# --- options ---------------------------------------------------------------------------------

_DAYS = re.compile(r"^\s*(\d{1,5})\s*d\s*$")


def parse_expires(text: str | None, now: datetime) -> str | None:
    """"2027-06-01", "2027-06-01T12:00:00Z" or "90d" (from now) -> RFC 3339 UTC; must lie in the future."""
    if text is None or text == "":
        return None
    m = _DAYS.match(text)
    if m:
        moment = now + timedelta(days=int(m.group(1)))
    else:
        try:
            moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise UsageError(f"expected --expires like 2027-06-01, 2027-06-01T12:00:00Z or 90d, "
                             f"found {text!r}") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
    if moment <= now:
        raise UsageError(f"expected --expires after now ({format_time(now)}), found {format_time(moment)}")
    return format_time(moment)


def _targets(target_ids: Sequence[str]) -> list[Target]:
    from runtime.profiles import get_profile

    if not target_ids:
        raise UsageError("expected at least one target id in --targets, found none")
    return [Target(id=t, backend=get_profile(t).backend) for t in target_ids]


def _omit_checkpoint_weights(files: list[PackFile], inputs: Sequence[ModelInput],
                             models: list[Model], jobs: int | None = None) -> tuple[list[PackFile], list[Model]]:
    """Drop the checkpoint files no target installs (engines carry their own weights); record each one
    (path, size, sha256) in its model's entry, so the signed manifest still pins what was left home.
    Files nobody hashed yet are hashed here (in parallel across files: they are not packed)."""
    from concurrent.futures import ThreadPoolExecutor

    from runtime import settings
    by_root = {m.root: m for m in inputs}
    omitted: dict[str, list[tuple[str, PackFile, tuple[int, str] | None]]] = {}
    kept = []
    for pf in files:
        root, _, rel = pf.path.partition("/")[2].partition("/")
        m = by_root.get(f"{MODELS_ROOT}/{root}")
        if m is None or pf.targets != ():
            kept.append(pf)
            continue
        known = (m.digests or {}).get(rel) or ((pf.src.stat().st_size, pf.sha256) if pf.sha256 else None)
        omitted.setdefault(m.root, []).append((rel, pf, known))
    todo = [pf for left in omitted.values() for _, pf, known in left if known is None]
    with ThreadPoolExecutor(max_workers=max(1, jobs or settings.jobs())) as pool:
        hashed = dict(zip((pf.src for pf in todo), pool.map(lambda pf: (pf.src.stat().st_size,
                                                                        file_sha256(pf.src)), todo)))
    listed = {root: [{"path": rel, "size": (known or hashed[pf.src])[0], "sha256": (known or hashed[pf.src])[1]}
                     for rel, pf, known in left] for root, left in omitted.items()}
    models = [replace(md, extra={**md.extra, "omitted_files": listed[md.root]}) if md.root in listed else md
              for md in models]
    return kept, models


def _check_or_discard(model: ModelInput, entry: Model, manifest: Manifest, out: Path) -> None:
    """model.check on what was packed; when it fails, the blobs of files whose bytes differ from what
    the hub or lock declares are removed (nobody signed them) and the bundle stays unfinished."""
    found = packed_digests(manifest, entry.root, entry.extra)
    try:
        model.check(found)
    except ResolveError as e:
        bad = getattr(e, "path", None)  # DigestMismatch names the file; otherwise every file not known before
        prefix = entry.root.rstrip("/") + "/"
        for f in manifest.files:
            rel = f.path[len(prefix):]
            if f.path.startswith(prefix) and (rel == bad if bad else rel not in (model.digests or {})):
                for p in f.parts:
                    if not p.stored:
                        (out / BLOBS_DIR / p.hex).unlink(missing_ok=True)
        raise


# --- the call --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CreateOptions:
    """What `bundle create` packs and how, as one value (bundler.cli.pack builds it from the flags)."""

    name: str
    version: int
    model: ModelInput
    targets: Sequence[str]  # validated ids (runtime.profiles.parse_targets)
    draft: ModelInput | None = None
    sign_keys: Sequence[Ed25519PrivateKey] = ()
    unsigned: bool = False  # --unsigned
    max_part_size: int = DEFAULT_MAX_PART_SIZE  # --max-part-size
    expires: str | None = None  # --expires: RFC 3339 or "90d", counted from `now`
    num_speculative_tokens: int = 3  # --num-speculative-tokens
    target_files: TargetFilesHook | None = None  # each target's engine files (bundler.pack.engines)
    serve: Mapping | None = None  # the bundle's serve defaults (--serve-config, -- flags)
    force: bool = False  # --force
    jobs: int | None = None  # --jobs
    now: datetime | None = None
    progress: bool = True  # not --no-progress
    builder: Builder | None = None
    checkpoint_weights: bool = False  # --with-checkpoint-weights
    speculative_method: str = "draft_model"  # or "eagle3"
    runtime_platforms: Sequence[str] = ()  # --with-runtime
    extra_wheels: Path | None = None  # --extra-wheels
    wheel_cache: Path | None = None  # --wheel-cache
    wheelhouse: object = None  # a bundler.pack.wheelhouse.Wheelhouse used as given


def create_bundle(out: Path, options: CreateOptions) -> Manifest:
    """Pack a target model (and optional draft) for `targets` into a signed bundle at `out`.

    `targets` are validated ids (manifests.targets.parse_targets); `expires` is RFC 3339 or
    a form parse_expires() takes ("90d"), counted from `now`. The bundle is the smallest that serves
    every target: checkpoint files that no target installs (every target's engines carry their own
    weights) are left out and listed in the manifest with size and sha256; a file some target installs
    always travels. `checkpoint_weights=True` carries them anyway, for a site that re-exports on the device.
    `runtime_platforms` (e.g. ["linux_aarch64-cp312"]) adds the floor runtime's wheelhouse for each and the
    bootstrap (bundler.pack.wheelhouse); `extra_wheels` is a folder of site wheels to add; `wheel_cache` keeps downloads;
    `wheelhouse` (a bundler.pack.wheelhouse.Wheelhouse) is used as given instead.
    """
    o = options
    name, version, model, draft, targets = o.name, o.version, o.model, o.draft, o.targets
    sign_keys, unsigned, max_part_size, expires = list(o.sign_keys), o.unsigned, o.max_part_size, o.expires
    num_speculative_tokens, target_files, serve = o.num_speculative_tokens, o.target_files, o.serve
    force, jobs, now, progress, builder = o.force, o.jobs, o.now, o.progress, o.builder
    checkpoint_weights, speculative_method = o.checkpoint_weights, o.speculative_method
    runtime_platforms, extra_wheels, wheel_cache = o.runtime_platforms, o.extra_wheels, o.wheel_cache
    wheelhouse = o.wheelhouse
    now = now or datetime.now(timezone.utc)
    if now.tzinfo is None:
        now = now.replace(tzinfo=timezone.utc)
    if not 1 <= num_speculative_tokens <= 16:
        raise UsageError(f"expected --num-speculative-tokens in 1..16, found {num_speculative_tokens}")
    expires = parse_expires(expires, now)
    inputs = [model] + ([draft] if draft is not None else [])
    if model.role != "target" or (draft is not None and draft.role != "draft"):
        raise UsageError("expected one model of role target and at most one of role draft")
    files = [pf for m in inputs for pf in model_files(m)]
    target_list = _targets(list(targets))

    config = _read_config(model)
    models = [Model(role=m.role, name=m.name or m.local_dir.name, root=m.root, source=m.source,
                    architecture=(_read_config(m).get("architectures") or [None])[0]) for m in inputs]
    serve = dict(serve or {})
    if "max_model_len" not in serve:
        mpe = config.get("max_position_embeddings")
        if isinstance(mpe, int) and mpe > 0:
            serve["max_model_len"] = min(mpe, MAX_MODEL_LEN_CAP)
    speculative = (Speculative(method=speculative_method, num_speculative_tokens=num_speculative_tokens,
                               model="draft") if draft is not None else None)

    def amend(manifest: Manifest) -> Manifest:
        """Check what pack hashed against what the resolver was told (before anything is finished), and
        pin local folders, which have no commit, by the digest of what was packed or left out."""
        for m, md in zip(inputs, manifest.models):
            if m.check is not None:
                _check_or_discard(m, md, manifest, out)
        pinned = tuple(m if m.source.revision else
                       replace(m, source=replace(m.source, revision="sha256:" + content_digest(
                           manifest.files, m.root, m.extra.get("omitted_files", ()))))
                       for m in manifest.models)
        return replace(manifest, models=pinned)

    with tempfile.TemporaryDirectory(prefix="bundle-create-") as work:
        house = wheelhouse
        if house is None and runtime_platforms:  # first: a pip failure should not come after a long export
            from bundler.pack.wheelhouse import build_wheelhouse, tensorrt_requirements
            log.info("wheelhouse: resolving the runtime's wheels for %s", ", ".join(runtime_platforms))
            house = build_wheelhouse(runtime_platforms, Path(work) / "wheelhouse", extra_wheels=extra_wheels,
                                     cache=wheel_cache,
                                     requirements=tensorrt_requirements([t.id for t in target_list], runtime_platforms))
        if house is not None:
            from bundler.pack.pack import check_stored_sizes
            check_stored_sizes(house.files, max_part_size)  # before the export, not after it
            log.info("wheelhouse: %s", "; ".join(f"{p}: {len(w)} wheels, {format_size(house.sizes.get(p, 0))}"
                                                 for p, w in house.runtime.platforms.items()))
        else:
            log.info("wheelhouse: none (no runtime platforms: devices bring their own runtime)")
        if target_files is not None:
            extra, target_list = target_files(inputs, target_list, Path(work))
            if all(t.engines for t in target_list):
                # Every engine carries its own weights: no device installs the checkpoint's weights (left
                # out below, or carried installed by none for re-export on another host).
                from bundler.resolve.select_files import is_weight_file
                files = [replace(pf, targets=()) if is_weight_file(pf.path) else pf for pf in files]
            files += list(extra)
        if not checkpoint_weights:
            files, models = _omit_checkpoint_weights(files, inputs, models, jobs)
        if house is not None:
            files += list(house.files)
        return pack_bundle(out, PackOptions(
            name=name, version=version, models=models, files=files, targets=target_list, speculative=speculative,
            serve=serve, expires=expires, sign_keys=sign_keys, unsigned=unsigned, max_part_size=max_part_size,
            jobs=jobs, now=now, progress=progress, force=force, builder=builder, amend=amend,
            runtime=house.runtime if house is not None else None))
