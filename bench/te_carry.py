"""Pack Transformer Engine for one device call: an installed TE tree, cut to one GPU architecture.

A developer's tool for the ``device`` machines, never the product's install path (that is
``launch/install_te.sh``, from PyPI).  TE's core wheel is 276 MB, the device call carries 64 MiB:
over five calls in pieces.  Most of it is GPU code for nine architectures (sm_75 .. sm_120);
this keeps the cubins of one (``--arch 90``: sm_90 and sm_90a, the H100/H200) and writes zeros
over the others inside the fatbins, the file layout unchanged (the CUDA driver picks the
entry for its own architecture and never opens the others), so the tree compresses to ~1/6.

    python3 bench/te_carry.py --wheels .whl/te /tmp/te_dl/transformer_engine_cu13-*.whl --out .whl/te_site.tar.xz
    # on the device (carry .whl): mkdir -p /tmp/te_site && tar -xJf .whl/te_site.tar.xz -C /tmp/te_site
    #                             export PYTHONPATH=/tmp/te_site:$PYTHONPATH

The wheels are installed with ``pip install --no-deps --target`` into a fresh folder first.
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import subprocess
import sys
import tarfile
import tempfile

MAGIC = struct.pack("<I", 0xBA55ED50)  # a fatbin container's header


def prune_fatbins(data: bytearray, keep_arch: int) -> tuple[int, int]:
    """Zero every cubin payload whose SM architecture is not ``keep_arch``; (kept, zeroed) bytes."""
    kept = zeroed = 0
    pos = data.find(MAGIC)
    while pos != -1:
        version, header, fat = struct.unpack_from("<HHQ", data, pos + 4)
        if version != 1 or header != 16:
            pos = data.find(MAGIC, pos + 4)
            continue
        entry, end = pos + 16, pos + 16 + fat
        while entry < end:
            _kind, _ver, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            start = entry + entry_header
            if arch == keep_arch:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            entry = start + payload
        pos = data.find(MAGIC, end)
    return kept, zeroed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", nargs="+", required=True, help="wheel files or folders of wheels")
    ap.add_argument("--arch", type=int, default=90, help="the SM architecture to keep (90: H100/H200)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    wheels = []
    for w in a.wheels:
        wheels += sorted(glob.glob(os.path.join(w, "*.whl"))) if os.path.isdir(w) else [w]
    with tempfile.TemporaryDirectory() as site:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", site, *wheels], check=True)
        for so in glob.glob(os.path.join(site, "**", "*.so*"), recursive=True):
            with open(so, "rb") as f:
                data = bytearray(f.read())
            if MAGIC not in data:
                continue
            kept, zeroed = prune_fatbins(data, a.arch)
            if zeroed:
                with open(so, "wb") as f:
                    f.write(data)
                print(f"[te_carry] {os.path.relpath(so, site)}: kept {kept / 1e6:.1f} MB of sm_{a.arch} cubins, "
                      f"zeroed {zeroed / 1e6:.1f} MB")
        with tarfile.open(a.out, "w:xz", preset=6) as tar:
            for name in sorted(os.listdir(site)):
                tar.add(os.path.join(site, name), arcname=name)
    print(f"[te_carry] {a.out}: {os.path.getsize(a.out) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
