#!/usr/bin/env python3
"""The library's layers, as docs/ARCHITECTURE.md draws them, checked against its #include lines.

Each folder of the library is a layer and may include only the layers listed for it below (and
itself); the public headers (include/tutti/) are the vocabulary every layer shares and include
only each other. An include that reaches up (the compiler including the runtime, the runtime the
collectives) fails this check with the file, the line and the rule it breaks.

Usage: check_layers.py SOURCE_ROOT
"""
import pathlib
import re
import sys

# Who may include whom. Lower layers first; a layer not listed includes only itself and tutti/.
ALLOWED = {
    "core": set(),
    "plan": {"core"},
    "dsl": {"core"},
    "topologies": {"core"},
    "compiler": {"core", "plan", "dsl", "topologies"},
    "runtime": {"core", "plan"},
    "collectives": {"core", "plan", "dsl", "topologies", "compiler", "runtime"},
    # Fused kernels build plans through the public API (tutti/); their CPU forms use core's element
    # code, and the dropout mask is drawn by the device's own function so both forms agree.
    "fused_kernels": {"core", "runtime"},
    "trainer": set(),  # the public API only
}
# Includes named by path from the source root: "layer/...". System headers use <...>.
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)/')
SOURCES = (".hpp", ".cpp", ".cu", ".cuh", ".h")


def layer_violations(root: pathlib.Path):
    for layer, below in ALLOWED.items():
        may = below | {layer, "tutti"}
        for path in sorted((root / layer).rglob("*")):
            if path.suffix not in SOURCES or not path.is_file():
                continue
            # A layer's own nested folders (runtime/device, collectives/include) are the layer.
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                m = INCLUDE.match(line)
                if m and m.group(1) not in may and (root / m.group(1)).is_dir():
                    yield f"{path.relative_to(root)}:{n}: {layer} includes {m.group(1)}/ (it may include {', '.join(sorted(may))})"
    for path in sorted((root / "include" / "tutti").rglob("*")):
        if path.suffix not in SOURCES or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if m and m.group(1) != "tutti":
                yield f"{path.relative_to(root)}:{n}: a public header includes {m.group(1)}/ (public headers include only tutti/)"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    root = pathlib.Path(sys.argv[1])
    missing = [layer for layer in ALLOWED if not (root / layer).is_dir()]
    if missing:
        print(f"check_layers: no folder for layer(s) {', '.join(missing)} under {root}", file=sys.stderr)
        return 1
    bad = list(layer_violations(root))
    for v in bad:
        print(v)
    if bad:
        print(f"check_layers: {len(bad)} include(s) against the layering", file=sys.stderr)
        return 1
    print(f"check_layers: {len(ALLOWED)} layers, every include goes down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
