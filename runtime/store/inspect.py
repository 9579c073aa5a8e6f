"""`bundle inspect`: what a bundle holds, readable without any key.

Nothing here is verified: signer key ids are read from the envelope and labelled unverified, so
an operator can see who claims to have signed before deciding which key to trust.
"""

from __future__ import annotations

from pathlib import Path

from manifests.errors import BadBundleError
from manifests.quantization import Quantization, quality_line
from manifests.sizes import format_size
from runtime.store.reader import open_bundle
from runtime.store.trust import parse_envelope


def inspect_bundle(bundle_dir: Path) -> dict:
    """A JSON-ready description of the bundle (works on incomplete bundles too, saying so)."""
    layout = open_bundle(Path(bundle_dir), require_complete=False)
    m = layout.unverified_manifest()
    signers: list[str] = []
    envelope_note = "none (unsigned)"
    if layout.envelope_bytes is not None:
        try:
            env = parse_envelope(layout.envelope_bytes)
            signers = env.key_ids
            envelope_note = "matches manifest" if env.payload == layout.manifest_bytes else \
                "payload DIFFERS from the manifest"
        except BadBundleError as e:
            envelope_note = f"unreadable: {e}"
    compressed = {p.digest: p.size for f in m.files for p in f.parts}
    models = []
    for model in m.models:
        prefix = model.root.rstrip("/") + "/"
        files = [f for f in m.files if f.path.startswith(prefix)]
        models.append({"role": model.role, "name": model.name, "root": model.root,
                       "architecture": model.architecture, "source": model.source.to_dict(),
                       "files": len(files), "size": sum(f.size for f in files)})
    targets = []
    for t in m.targets:
        files = m.files_for(t.id)
        targets.append({"id": t.id, "backend": t.backend, "files": len(files), "size": sum(f.size for f in files),
                        "compressed_size": sum({p.digest: p.size for f in files for p in f.parts}.values()),
                        "engines": [{"model": e.model, "backend": e.backend, "format": e.format, "path": e.path,
                                     **_quantization(e)} for e in t.engines], "build": t.build})
    return {
        "path": str(layout.path),
        "complete": layout.complete,
        "name": m.name, "version": m.version, "format_version": m.format_version,
        "created": m.created, "expires": m.expires,
        "builder": m.builder.to_dict(),
        "models": models,
        "targets": targets,
        "speculative": m.speculative.to_dict() if m.speculative else None,
        "serve": m.serve,
        "files": len(m.files),
        "size": m.total_size,
        "compressed_size": sum(compressed.values()),
        "blobs": len(compressed),
        "left_out": _left_out(m.models),
        "installed_by_no_target": sum(f.size for f in m.files if f.targets == () and f.path not in _runtime_paths(m)),
        "runtime": runtime_summary(m),
        "signatures": {"key_ids": signers, "verified": False, "envelope": envelope_note},
    }


def _quantization(engine) -> dict:
    """{"quantization": record} of a 4-bit engine (manifests.quantization), {} otherwise; unverified, so a
    malformed record is shown as such, not trusted."""
    q = engine.build.get("quantization")
    if q is None:
        return {}
    try:
        Quantization.from_dict(q)
    except BadBundleError as e:
        return {"quantization": {"unreadable": str(e)}}
    return {"quantization": q}


def _runtime_paths(m) -> set[str]:
    """The wheelhouse and bootstrap: installed by no target, but not checkpoint weights either."""
    if m.runtime is None:
        return set()
    return set(m.runtime.wheel_paths()) | {m.runtime.bootstrap}


def _quantization_lines(engine: dict) -> list[str]:
    q = engine.get("quantization")
    if q is None:
        return [] if engine["format"] != "onnx" else [f"    {engine['model']}: weights not quantized"]
    if "unreadable" in q:
        return [f"    {engine['model']}: quantization record unreadable: {q['unreadable']}"]
    rec = Quantization.from_dict(q)
    lines = [f"    {engine['model']}: {rec.summary}, {rec.operator} ({rec.source})"]
    if rec.quality:
        lines.append(f"    {engine['model']}: quality {quality_line(rec.quality)}")
    return lines


def _left_out(models) -> list[dict]:
    """Files create left home (no target installs them), from each model's omitted_files; malformed entries
    of this unverified manifest are skipped, not trusted."""
    out = []
    for md in models:
        entries = md.extra.get("omitted_files")
        for o in entries if isinstance(entries, list) else ():
            if isinstance(o, dict) and isinstance(o.get("path"), str) and isinstance(o.get("size"), int):
                out.append({"model": md.role, "path": o["path"], "size": o["size"], "sha256": str(o.get("sha256"))})
    return out


def runtime_summary(m) -> dict | None:
    """The wheelhouse (format 2): package and version, each platform's wheel count and size, the total stored."""
    if m.runtime is None:
        return None
    by_path = {f.path: f for f in m.files}
    platforms = {plat: {"wheels": len(paths), "size": sum(by_path[p].size for p in paths)}
                 for plat, paths in m.runtime.platforms.items()}
    return {"package": m.runtime.package, "version": m.runtime.version, "platforms": platforms,
            "wheelhouse_size": sum(by_path[p].size for p in m.runtime.wheel_paths()),
            "bootstrap": m.runtime.bootstrap}


def format_inspect(info: dict) -> str:
    """The human-readable form of `inspect_bundle`'s result."""
    lines = [f"{info['name']} v{info['version']}  (format {info['format_version']})"
             + ("" if info["complete"] else "  INCOMPLETE: COMPLETE marker missing"),
             f"  created   {info['created']}  by {info['builder'].get('tool', '')} "
             f"{info['builder'].get('tool_version', '')} on {info['builder'].get('host', '')}",
             f"  expires   {info['expires'] or 'never'}",
             f"  size      {format_size(info['size'])} in {info['files']} files, "
             f"{format_size(info['compressed_size'])} in {info['blobs']} blobs"]
    for m in info["models"]:
        src = m["source"]
        origin = src.get("repo") or src.get("path") or src.get("type")
        rev = src.get("revision") or "-"
        lines.append(f"  model     {m['role']}: {m['name']}  {origin} @ {rev}  "
                     f"{format_size(m['size'])} ({m['architecture'] or 'unknown architecture'})")
    for t in info["targets"]:
        engines = ", ".join(f"{e['model']}:{e['format']}" for e in t["engines"]) or "no engines"
        lines.append(f"  target    {t['id']} ({t['backend']}): {format_size(t['size'])} to install "
                     f"({format_size(t['compressed_size'])} compressed), {engines}")
        for e in t["engines"]:
            lines += _quantization_lines(e)
    if info["installed_by_no_target"]:
        lines.append(f"  carried   {format_size(info['installed_by_no_target'])} that no target installs "
                     f"(checkpoint weights, for re-export)")
    for o in info["left_out"]:
        lines.append(f"  left out  {o['model']}: {o['path']}  {format_size(o['size'])}  sha256:{o['sha256']}")
    spec = info["speculative"]
    lines.append("  speculative " + (", ".join(f"{k}={v}" for k, v in spec.items()) if spec else "off"))
    if info["serve"]:
        lines.append("  serve     " + ", ".join(f"{k}={v}" for k, v in sorted(info["serve"].items())))
    rt = info.get("runtime")
    if rt:
        plats = ", ".join(f"{p} ({v['wheels']} wheels, {format_size(v['size'])})" for p, v in rt["platforms"].items())
        lines.append(f"  runtime   {rt['package']} {rt['version']}: wheelhouse {format_size(rt['wheelhouse_size'])} "
                     f"for {plats}; bootstrap: sh {info['path']}/{rt['bootstrap']} --trust KEY.pub")
    else:
        lines.append("  runtime   not included (install bundle-runtime on the device another way)")
    sig = info["signatures"]
    ids = ", ".join(sig["key_ids"]) or "none"
    lines.append(f"  signed by {ids}  (UNVERIFIED key ids; envelope {sig['envelope']}; "
                 f"check with: bundle verify DIR --trust KEY.pub)")
    return "\n".join(lines)
