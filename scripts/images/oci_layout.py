"""Wrap a rootfs tarball as a one-layer OCI image layout, byte for byte reproducible.

Usage: oci_layout.py ROOTFS_TAR LAYOUT_DIR TAG CREATED_EPOCH
The layer is the tarball itself (uncompressed: no compressor version can change the digest), the
config's dates are CREATED_EPOCH. Prints the manifest digest (sha256:...).
"""

import hashlib
import json
import os
import shutil
import sys
import time


def blob(layout: str, data: bytes | None = None, path: str | None = None) -> tuple[str, int]:
    h = hashlib.sha256()
    if data is None:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        size = os.path.getsize(path)
    else:
        h.update(data)
        size = len(data)
    dest = os.path.join(layout, "blobs", "sha256", h.hexdigest())
    if data is None:
        shutil.copyfile(path, dest)
    else:
        with open(dest, "wb") as f:
            f.write(data)
    return "sha256:" + h.hexdigest(), size


def main() -> None:
    rootfs, layout, tag, epoch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.makedirs(os.path.join(layout, "blobs", "sha256"), exist_ok=True)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    layer, layer_size = blob(layout, path=rootfs)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
            "Cmd": ["python3"],
        },
        "rootfs": {"type": "layers", "diff_ids": [layer]},
        "history": [{"created": created, "created_by": "scripts/images/base.sh (mmdebstrap)"}],
    }
    cfg, cfg_size = blob(layout, data=json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": layer_size}],
    }
    man, man_size = blob(layout, data=json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man, "size": man_size,
                       "annotations": {"org.opencontainers.image.ref.name": tag}}],
    }
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump(index, f, sort_keys=True, separators=(",", ":"))
    print(man)


if __name__ == "__main__":
    main()
