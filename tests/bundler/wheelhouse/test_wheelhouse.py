"""The wheelhouse in the bundle: stored blobs with their own media type, listed in the signed manifest,
one copy of a wheel shared by platforms, site wheels by tag, the format version it needs, what inspect shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bundler.pack.pack import PackFile, PackOptions, pack_bundle
from bundler.pack.wheelhouse import (
    default_platforms, host_platform, parse_platforms, pip_platform_args, wheel_fits, wheelhouse_from_files,
)
from manifests import layout as L
from manifests.errors import BadBundleError, UsageError
from manifests.schema import Manifest, Model, ModelSource, Target
from runtime.store.inspect import format_inspect, inspect_bundle
from runtime.store.store import Store
from runtime.store.verify import verify_bundle
from tests.runtime.store.craft import oci_manifest
from tests.wheels import make_wheel


def test_platforms_follow_the_targets():
    assert default_platforms(["jetson-thor"]) == ["linux_aarch64-cp312"]
    assert default_platforms(["jetson-thor", "igx-thor", "dgx-spark"]) == ["linux_aarch64-cp312"]
    assert default_platforms(["cpu"]) == [host_platform()]
    assert default_platforms(["jetson-agx-orin"]) == ["linux_aarch64-cp310"]


def test_every_built_in_profile_names_its_runtime_platform_or_null():
    from manifests.targets import all_profiles

    for p in all_profiles():
        assert "runtime_platform" in p.extra, p.id  # a platform, "build-host" (cpu) or null (cuda: ask)


def test_cuda_has_no_default_runtime_platform_create_asks_for_one(tmp_path, capsys):
    """A `cuda` device is any x86_64 or aarch64 machine with any Python: no runtime for the build host's
    Python (a 3.11 wheelhouse does not install on a 3.12 device); create asks, in one line, before any work."""
    from bundler.cli.pack import runtime_platforms
    from runtime.cli.main import main

    with pytest.raises(UsageError, match=r"target cuda names no runtime platform.*--with-runtime.*--no-runtime"):
        default_platforms(["cpu", "cuda"])
    assert runtime_platforms("linux_x86_64-cp312", False, ["cuda"]) == ["linux_x86_64-cp312"]
    assert runtime_platforms(None, True, ["cuda"]) == []
    code = main(["create", "--targets", "cuda", "--name", "d", "--version", "1", "--unsigned", "--no-progress",
                 "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == UsageError.exit_code and err.count("\n") == 1, err
    assert "expected --with-runtime PLATFORM" in err and "linux_x86_64-cp312" in err and "--no-runtime" in err
    assert not (tmp_path / "b").exists()


def test_a_site_profile_without_runtime_platform_is_asked_for_one_too(tmp_path, monkeypatch):
    from manifests.targets import get_profile

    board = {k: v for k, v in get_profile("jetson-thor").to_dict().items() if k != "runtime_platform"}
    (tmp_path / "my-board.json").write_text(json.dumps({**board, "id": "my-board"}))
    (tmp_path / "bad-board.json").write_text(json.dumps({**board, "id": "bad-board", "runtime_platform": "arm64"}))
    monkeypatch.setenv("BUNDLE_PROFILE_DIR", str(tmp_path))
    with pytest.raises(UsageError, match="target my-board names no runtime platform"):
        default_platforms(["my-board"])
    with pytest.raises(UsageError, match=r"bad-board.json \(bad-board\): expected runtime_platform like "
                                         r"linux_aarch64-cp312, 'build-host' or null, found 'arm64'"):
        default_platforms(["bad-board"])


def test_platform_list_is_validated():
    assert parse_platforms("linux_aarch64-cp312, linux_x86_64-cp311,linux_aarch64-cp312") == [
        "linux_aarch64-cp312", "linux_x86_64-cp311"]
    with pytest.raises(UsageError, match="linux_aarch64-cp312"):
        parse_platforms("aarch64")
    with pytest.raises(UsageError):
        parse_platforms(" , ")


def test_pip_is_told_every_manylinux_tag_of_the_platform():
    args = pip_platform_args("linux_aarch64-cp312")
    plats = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert "manylinux_2_35_aarch64" in plats and "manylinux_2_17_aarch64" in plats and "manylinux2014_aarch64" in plats
    assert not any("x86_64" in p for p in plats)
    assert args[args.index("--python-version") + 1] == "3.12" and args[args.index("--abi") + 1] == "cp312"
    assert "--only-binary=:all:" in args


@pytest.mark.parametrize("name,plat,fits", [
    ("x-1-py3-none-any.whl", "linux_aarch64-cp312", True),
    ("tensorrt-10.13-cp312-none-manylinux_2_28_aarch64.whl", "linux_aarch64-cp312", True),
    ("tensorrt-10.13-cp312-none-manylinux_2_28_aarch64.whl", "linux_x86_64-cp312", False),
    ("tensorrt-10.13-cp312-none-manylinux_2_28_aarch64.whl", "linux_aarch64-cp311", False),
    ("cryptography-50-cp311-abi3-manylinux_2_34_x86_64.whl", "linux_x86_64-cp312", True),
    ("cryptography-50-cp311-abi3-manylinux_2_34_x86_64.whl", "linux_x86_64-cp310", False),
    ("numpy-2-cp312-cp312-musllinux_1_2_aarch64.whl", "linux_aarch64-cp312", False),
])
def test_site_wheels_go_to_the_platforms_their_tags_fit(name, plat, fits):
    assert wheel_fits(name, plat) is fits


def _pack_with(tmp_path: Path, per_platform: dict[str, list[Path]], extra_files=()) -> Path:
    house = wheelhouse_from_files("tiny-runtime", "1.0", per_platform)
    model = tmp_path / "m.bin"
    model.write_bytes(b"weights" * 1000)
    out = tmp_path / "bundle"
    pack_bundle(out, PackOptions(name="w", version=1,
                models=[Model("target", "t", "models/target", ModelSource("local", revision="x"))],
                files=[PackFile(model, "models/target/m.bin"), *house.files, *extra_files],
                targets=[Target("cpu", "onnxruntime")], speculative=None, serve={}, expires=None, sign_keys=[],
                unsigned=True, progress=False, runtime=house.runtime))
    return out


def test_wheels_are_stored_blobs_of_their_own_media_type_listed_in_the_signed_manifest(tmp_path):
    shared = make_wheel(tmp_path / "w", "tiny-runtime", "1.0")
    arm = make_wheel(tmp_path / "w", "native", "2.0", tag="cp312-cp312-manylinux_2_28_aarch64")
    x86 = make_wheel(tmp_path / "w", "native", "2.0", tag="cp312-cp312-manylinux_2_28_x86_64",
                     module_source="X = 2\n")
    out = _pack_with(tmp_path, {"linux_aarch64-cp312": [shared, arm], "linux_x86_64-cp312": [shared, x86]})
    vb = verify_bundle(out, {}, allow_unsigned=True)
    m = vb.manifest
    assert m.format_version == 2
    wheels = [f for f in m.files if f.path.startswith("wheelhouse/")]
    assert sorted(f.path for f in wheels) == sorted(f"wheelhouse/{w.name}" for w in (shared, arm, x86))  # shared once
    assert m.runtime.platforms["linux_aarch64-cp312"] == tuple(sorted(f"wheelhouse/{w.name}" for w in (shared, arm)))
    layers = {d["digest"]: d["mediaType"] for d in oci_manifest(out)["layers"]}
    for f in wheels:
        (part,) = f.parts
        assert part.compression == "none" and part.hex == f.sha256 and part.size == f.size
        blob = out / L.blob_path(part.digest)
        assert blob.read_bytes() == (tmp_path / "w" / f.path.split("/")[1]).read_bytes()  # the wheel as is
        assert layers[part.digest] == L.WHEEL_MEDIA_TYPE
        assert f.targets == ()
    boot = next(f for f in m.files if f.path == "bootstrap")
    assert layers[boot.parts[0].digest] == L.BOOTSTRAP_MEDIA_TYPE
    assert (out / "bootstrap").read_bytes() == (out / L.blob_path(boot.parts[0].digest)).read_bytes()
    assert {d["mediaType"] for d in oci_manifest(out)["layers"]} >= {L.PART_MEDIA_TYPE}  # the model is still zstd


def test_no_target_installs_the_wheelhouse(tmp_path):
    shared = make_wheel(tmp_path / "w", "tiny-runtime", "1.0")
    out = _pack_with(tmp_path, {"linux_x86_64-cp311": [shared]})
    inst = Store(tmp_path / "store").install(out, target="cpu", trusted={}, allow_unsigned=True, progress=False)
    assert (inst.path / "models/target/m.bin").is_file()
    assert not (inst.path / "wheelhouse").exists() and not (inst.path / "bootstrap").exists()


def test_a_bundle_without_a_wheelhouse_stays_format_1(tmp_path):
    model = tmp_path / "m.bin"
    model.write_bytes(b"x" * 100)
    m = pack_bundle(tmp_path / "b", PackOptions(name="w", version=1, models=[], files=[PackFile(model, "m.bin")],
                    targets=[Target("cpu", "onnxruntime")], speculative=None, serve={}, expires=None,
                    sign_keys=[], unsigned=True, progress=False))
    assert m.format_version == 1 and m.runtime is None
    assert not (tmp_path / "b" / "bootstrap").exists()


def test_inspect_shows_runtime_platforms_version_and_wheelhouse_size(tmp_path):
    shared = make_wheel(tmp_path / "w", "tiny-runtime", "1.0")
    arm = make_wheel(tmp_path / "w", "native", "2.0", tag="cp312-cp312-manylinux_2_28_aarch64")
    out = _pack_with(tmp_path, {"linux_aarch64-cp312": [shared, arm], "linux_x86_64-cp311": [shared]})
    info = inspect_bundle(out)
    rt = info["runtime"]
    assert rt["package"] == "tiny-runtime" and rt["version"] == "1.0"
    assert rt["platforms"]["linux_aarch64-cp312"] == {"wheels": 2, "size": shared.stat().st_size + arm.stat().st_size}
    assert rt["wheelhouse_size"] == shared.stat().st_size + arm.stat().st_size
    text = format_inspect(info)
    assert "runtime   tiny-runtime 1.0" in text and "linux_aarch64-cp312 (2 wheels" in text
    assert "linux_x86_64-cp311 (1 wheels" in text


def _manifest_dict(**runtime_overrides) -> dict:
    sha = "a" * 64
    d = {"format_version": 2, "name": "w", "version": 1, "created": "2026-11-29T00:00:00Z", "models": [],
         "builder": {"host": "", "platform": "", "tool": "bundle", "tool_version": ""}, "serve": {},
         "targets": [], "files": [{"path": "wheelhouse/x-1-py3-none-any.whl", "size": 5, "sha256": sha, "targets": [],
                                   "parts": [{"digest": "sha256:" + sha, "size": 5, "offset": 0, "length": 5,
                                              "compression": "none"}]}],
         "runtime": {"package": "bundle-runtime", "version": "0.1.0",
                     "platforms": {"linux_x86_64-cp311": ["wheelhouse/x-1-py3-none-any.whl"]}}}
    d["runtime"].update(runtime_overrides)
    return d


def test_schema_round_trips_a_runtime_section():
    d = _manifest_dict()
    m = Manifest.from_dict(d)
    assert m.runtime.platforms == {"linux_x86_64-cp311": ("wheelhouse/x-1-py3-none-any.whl",)}
    assert json.loads(m.to_json_bytes()) == d


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format_version=1), "format_version >= 2"),
    (lambda d: d["files"][0]["parts"][0].update(digest="sha256:" + "b" * 64), "stored"),
    (lambda d: d["files"][0].update(targets=["cpu"]), "no target installs"),
    (lambda d: d["runtime"]["platforms"].update({"windows-cp311": []}), "platform like"),
    (lambda d: d["runtime"]["platforms"].update({"linux_x86_64-cp312": ["wheelhouse/missing.whl"]}), "no such file"),
    (lambda d: (d["files"][0].update(path="models/x.whl"),
                d["runtime"].update(platforms={"linux_x86_64-cp311": ["models/x.whl"]})), "wheel paths like"),
    (lambda d: d["files"][0]["parts"][0].update(compression="gzip"), "compression"),
])
def test_schema_refuses_inconsistent_runtime_sections(change, message):
    d = _manifest_dict()
    change(d)
    with pytest.raises(BadBundleError, match=message):
        Manifest.from_dict(d)


def test_extra_wheels_are_carried_for_the_platforms_they_fit(tmp_path, monkeypatch):
    """--extra-wheels: a site's aarch64 wheel joins the aarch64 wheelhouse only (pip resolution stubbed out)."""
    import bundler.pack.wheelhouse as wh

    site = tmp_path / "site"
    floor = make_wheel(site, "bundle-runtime", wh.floor_version())
    trt = make_wheel(site, "tensorrt-bindings", "10.13", tag="cp312-none-manylinux_2_28_aarch64")
    asked = {}

    def fake_download(plat, requirements, find_links, cache, work):
        asked[plat] = requirements
        return [Path(r) if r.endswith(".whl") else floor for r in requirements]

    monkeypatch.setattr(wh, "download_platform", fake_download)
    house = wh.build_wheelhouse(["linux_aarch64-cp312", "linux_x86_64-cp312"], tmp_path / "work", extra_wheels=site,
                                cache=tmp_path / "cache")
    assert asked["linux_aarch64-cp312"] == [f"bundle-runtime=={wh.floor_version()}", str(trt)]
    assert asked["linux_x86_64-cp312"] == [f"bundle-runtime=={wh.floor_version()}"]
    assert f"wheelhouse/{trt.name}" in house.runtime.platforms["linux_aarch64-cp312"]
    assert f"wheelhouse/{trt.name}" not in house.runtime.platforms["linux_x86_64-cp312"]
    assert f"wheelhouse/{floor.name}" in house.runtime.platforms["linux_x86_64-cp312"]  # the floor wheel given


def test_extra_wheels_must_be_a_folder(tmp_path):
    import bundler.pack.wheelhouse as wh

    with pytest.raises(UsageError, match="--extra-wheels"):
        wh.build_wheelhouse(["linux_x86_64-cp311"], tmp_path / "w", extra_wheels=tmp_path / "nope")


def test_with_and_no_runtime_together_is_a_usage_error(tmp_path, capsys):
    from runtime.cli.main import main

    code = main(["create", "--targets", "cpu", "--name", "d", "--version", "1", "--unsigned", "--no-progress",
                 "--with-runtime", "linux_x86_64-cp311", "--no-runtime", "--out", str(tmp_path / "b")])
    assert code == 2 and "--with-runtime or --no-runtime" in capsys.readouterr().err


def test_copy_carries_the_bootstrap_from_its_blob(tmp_path):
    from runtime.store.copy import copy_bundle

    shared = make_wheel(tmp_path / "w", "tiny-runtime", "1.0")
    out = _pack_with(tmp_path, {"linux_x86_64-cp311": [shared]})
    (out / "bootstrap").write_text("#!/bin/sh\necho tampered on the source\n")  # not what was signed
    copy_bundle(out, tmp_path / "dst", progress=False)
    boot = next(f for f in verify_bundle(tmp_path / "dst", {}, allow_unsigned=True).manifest.files
                if f.path == "bootstrap")
    assert (tmp_path / "dst" / "bootstrap").read_bytes() == (out / L.blob_path(boot.parts[0].digest)).read_bytes()


def test_a_stored_file_a_target_needs_installs_like_a_compressed_one(tmp_path):
    """Format 2 lets any file be stored; install copies it (checked) instead of treating it as zstd."""
    payload = tmp_path / "table.bin"
    payload.write_bytes(bytes(range(256)) * 4096)
    out = tmp_path / "b"
    pack_bundle(out, PackOptions(name="s", version=1, models=[], files=[PackFile(payload, "data/table.bin", media_type=L.WHEEL_MEDIA_TYPE)],
                targets=[Target("cpu", "onnxruntime")], speculative=None, serve={}, expires=None, sign_keys=[],
                unsigned=True, progress=False))
    inst = Store(tmp_path / "store").install(out, target="cpu", trusted={}, allow_unsigned=True, progress=False)
    assert (inst.path / "data/table.bin").read_bytes() == payload.read_bytes()
    assert inst.manifest.format_version == 2


@pytest.mark.parametrize("swap", ["wheel-as-zstd-part", "zstd-part-as-wheel", "unknown-media-type"])
def test_layer_media_types_must_match_how_each_part_is_stored(swap, tmp_path):
    """A stored wheel passed off as a zstd part (or the reverse, or a made-up type) is a bad bundle."""
    from tests.runtime.store.craft import write_oci_manifest

    out = _pack_with(tmp_path, {"linux_x86_64-cp311": [make_wheel(tmp_path / "w", "tiny-runtime", "1.0")]})
    oci = oci_manifest(out)
    kind = {"wheel-as-zstd-part": L.WHEEL_MEDIA_TYPE, "zstd-part-as-wheel": L.PART_MEDIA_TYPE,
            "unknown-media-type": L.WHEEL_MEDIA_TYPE}[swap]
    layer = next(d for d in oci["layers"] if d["mediaType"] == kind)
    layer["mediaType"] = {"wheel-as-zstd-part": L.PART_MEDIA_TYPE, "zstd-part-as-wheel": L.WHEEL_MEDIA_TYPE,
                          "unknown-media-type": "application/x-executable"}[swap]
    write_oci_manifest(out, oci)
    with pytest.raises(BadBundleError, match="mediaType"):
        verify_bundle(out, {}, allow_unsigned=True)
    with pytest.raises(BadBundleError, match="mediaType"):
        Store(tmp_path / "store").install(out, target="cpu", trusted={}, allow_unsigned=True, progress=False)


def test_a_wheel_over_max_part_size_is_refused_by_name_and_size_before_the_export(tmp_path):
    """Stored wheels are never split (the bootstrap checks each one with sha256sum): a 17 MiB wheel with
    --max-part-size 8M is one line naming it and its size, before the engines are exported."""
    from bundler.pack.create import CreateOptions, create_bundle, local_model
    from tests.models import make_tiny_checkpoint

    big = tmp_path / "w" / "big_native-1.0-py3-none-any.whl"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(17 * 1024 * 1024)
    house = wheelhouse_from_files("tiny-runtime", "1.0", {"linux_x86_64-cp312": [make_wheel(tmp_path / "w",
                                                                                          "tiny-runtime", "1.0"), big]})
    exported = []
    model = local_model(make_tiny_checkpoint(tmp_path / "m", hidden_size=64, num_layers=2), "target")
    with pytest.raises(UsageError) as e:
        create_bundle(tmp_path / "b", CreateOptions(name="w", version=1, model=model, draft=None, targets=["cpu"], sign_keys=[],
                      unsigned=True, progress=False, max_part_size=8 * 1024 * 1024, wheelhouse=house,
                      target_files=lambda inputs, targets, work: exported.append(1) or ([], list(targets))))
    msg = str(e.value)
    assert "wheelhouse/big_native-1.0-py3-none-any.whl is 17.0 MiB" in msg and "--max-part-size 8.0 MiB" in msg
    assert "\n" not in msg and not exported and not (tmp_path / "b").exists()
    # pack_bundle itself refuses it too (build-engines and other callers), before writing anything
    with pytest.raises(UsageError, match="big_native-1.0-py3-none-any.whl is 17.0 MiB"):
        pack_bundle(tmp_path / "b2", PackOptions(name="w", version=1, models=[], files=list(house.files),
                    targets=[Target("cpu", "onnxruntime")], speculative=None, serve={}, expires=None, sign_keys=[],
                    unsigned=True, progress=False, max_part_size=8 * 1024 * 1024, runtime=house.runtime))
    assert not (tmp_path / "b2").exists()
    # with room for it, the wheel is one stored blob of its own size (what the bootstrap checks)
    (tmp_path / "fits").mkdir()
    out = _pack_with(tmp_path / "fits", {"linux_x86_64-cp312": [big]})
    entry = next(f for f in verify_bundle(out, {}, allow_unsigned=True).manifest.files if f.path.endswith(big.name))
    assert [(p.size, p.compression) for p in entry.parts] == [(17 * 1024 * 1024, "none")]


def test_tensorrt_targets_wheelhouses_carry_cuda_python_of_their_cuda_major(tmp_path, monkeypatch):
    """The platform's TensorRT is linked in by the bootstrap; the engine's cuda-python travels in the wheelhouse."""
    import bundler.pack.wheelhouse as wh

    reqs = wh.tensorrt_requirements(["jetson-thor", "dgx-spark", "jetson-agx-orin", "cpu"],
                                    ["linux_aarch64-cp312", "linux_aarch64-cp310", "linux_x86_64-cp311"])
    assert reqs == {"linux_aarch64-cp312": ["cuda-bindings>=13.0,<14"],  # JetPack 7, DGX OS 7: CUDA 13
                    "linux_aarch64-cp310": ["cuda-bindings>=12.6,<13"]}  # JetPack 6 (Orin): CUDA 12.6
    assert wh.tensorrt_requirements(["cpu", "cuda"], ["linux_aarch64-cp312"]) == {}

    site = tmp_path / "site"
    floor = make_wheel(site, "bundle-runtime", wh.floor_version())
    asked = {}

    def fake_download(plat, requirements, find_links, cache, work):
        asked[plat] = requirements
        return [floor]

    monkeypatch.setattr(wh, "download_platform", fake_download)
    wh.build_wheelhouse(["linux_aarch64-cp312", "linux_x86_64-cp311"], tmp_path / "work", extra_wheels=site,
                        cache=tmp_path / "cache", requirements=reqs)
    assert asked["linux_aarch64-cp312"] == [f"bundle-runtime=={wh.floor_version()}", "cuda-bindings>=13.0,<14"]
    assert asked["linux_x86_64-cp311"] == [f"bundle-runtime=={wh.floor_version()}"]
