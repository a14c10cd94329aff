#!/usr/bin/env python3
"""Regenerates docs/ENVIRONMENT.md from the table in core/env.cpp (test_env checks they agree)."""
import pathlib
import re

root = pathlib.Path(__file__).resolve().parent.parent
src = (root / "core/env.cpp").read_text()
table = src[src.index("kVariables[] = {"):src.index("};", src.index("kVariables[] = {"))]
rows = []
for m in re.finditer(r'\{\s*"(\w+)",\s*"([^"]*)",\s*"([^"]*)",\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\}', table):
    name, alias, default, meaning = m.group(1), m.group(2), m.group(3), m.group(4)
    meaning = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', meaning)).replace('\\"', '"')
    rows.append(f"| `{name}` | {('`' + alias + '`') if alias else ''} | {('`' + default + '`') if default else '(unset)'} | {meaning} |")
out = """# Environment variables

Every variable tutti reads is declared in one table in `core/env.cpp`; this page is generated from it
by `tools/gen_env_doc.py`, and `test_env` fails if a declared variable is missing here. Where NCCL has
a name for the same setting, tutti honours it too; the `TUTTI_*` spelling wins when both are set.

| variable | NCCL alias | default | meaning |
|---|---|---|---|
""" + "\n".join(rows) + """

Launcher variables read as stand-ins (not tutti's own): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
`OMPI_COMM_WORLD_LOCAL_RANK` (Open MPI's mpirun), `PMI_RANK`, `PMI_SIZE` (PMI launchers), `SLURM_PROCID`,
`SLURM_NTASKS`, `SLURM_LOCALID` (srun). `tutti-run` sets `TUTTI_RANK`, `TUTTI_SIZE`, `TUTTI_LOCAL_RANK`,
`TUTTI_LOCAL_SIZE` and `TUTTI_COMM_ID`.

NCCL variables tutti does not read, because the setting has no counterpart here (tutti's own
transports, thread blocks and plans replace it): `NCCL_IB_*`, `NCCL_NET*`, `NCCL_SHM_DISABLE` (shared
memory is chosen per pair by the transport registry; `TUTTI_TRANSPORT=tcp` turns it off),
`NCCL_P2P_LEVEL`, `NCCL_NVLS_ENABLE`, `NCCL_COLLNET_ENABLE`, `NCCL_CROSS_NIC`, `NCCL_GRAPH_FILE`,
`NCCL_TOPO_DUMP_FILE`, `NCCL_LAUNCH_MODE`, `NCCL_CUMEM_ENABLE`, `NCCL_NVB_DISABLE`, `NCCL_CHECKS_DISABLE`,
`NCCL_LL_THRESHOLD`, `NCCL_TREE_THRESHOLD`, `NCCL_SINGLE_RING_THRESHOLD`. ncclConfig_t fields other than
`blocking` (`cgaClusterSize`, `minCTAs`, `maxCTAs`, `netName`, `splitShare`, `CTAPolicy`, ...) are accepted
and likewise have no effect.
"""
(root / "docs/ENVIRONMENT.md").write_text(out)
print(f"{len(rows)} variables")
