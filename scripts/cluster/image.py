#!/usr/bin/env python3
"""Wrap a root filesystem as a one-layer image archive (docker-archive format: manifest.json with
RepoTags) that `ctr -n k8s.io images import` loads under its name. Used by scripts/cluster/build.sh
(the pause image) and scripts/cluster/test-image.sh (the smoke-test image). Standard library only.

  image.py --rootfs DIR | --rootfs-tar TAR  --name REF --out ARCHIVE
           [--entrypoint /path ...] [--cmd ...] [--user UID:GID] [--env K=V ...] [--workdir DIR]
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--rootfs")
    src.add_argument("--rootfs-tar")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--entrypoint", nargs="*", default=None)
    ap.add_argument("--cmd", nargs="*", default=None)
    ap.add_argument("--user", default="")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--workdir", default="/")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(a.out))) as tmp:
        layer = os.path.join(tmp, "layer.tar")
        if a.rootfs_tar:
            shutil.copyfile(a.rootfs_tar, layer)
        else:
            with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as t:
                for name in sorted(os.listdir(a.rootfs)):
                    t.add(os.path.join(a.rootfs, name), arcname=name)
        diff = sha256_file(layer)
        cfg = {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *a.env],
                "WorkingDir": a.workdir,
                **({"Entrypoint": a.entrypoint} if a.entrypoint else {}),
                **({"Cmd": a.cmd} if a.cmd else {}),
                **({"User": a.user} if a.user else {}),
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff}"]},
            "history": [{"created_by": "scripts/cluster/image.py"}],
        }
        cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
        cfg_sha = hashlib.sha256(cfg_bytes).hexdigest()
        manifest = [{"Config": f"{cfg_sha}.json", "RepoTags": [a.name], "Layers": [f"{diff}/layer.tar"]}]
        out_tmp = a.out + ".tmp"
        with tarfile.open(out_tmp, "w", format=tarfile.PAX_FORMAT) as t:
            def add_bytes(name: str, data: bytes) -> None:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                ti.mode = 0o644
                t.addfile(ti, io.BytesIO(data))
            add_bytes(f"{cfg_sha}.json", cfg_bytes)
            t.add(layer, arcname=f"{diff}/layer.tar")
            add_bytes("manifest.json", json.dumps(manifest).encode())
        os.replace(out_tmp, a.out)


if __name__ == "__main__":
    main()
