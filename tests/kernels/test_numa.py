"""NUMA awareness (kernels/cpu/machine.py) against fake sysfs trees: the node layout (cpulist, meminfo), physical
cores from the topology, and the CPU experts' cores: one node's physical cores on a two-socket host, every core on
one node; the placement line names the node."""

from pathlib import Path

from moeserve.hybrid.placement import HybridPlacement
from moeserve.kernels.cpu.machine import (ExpertCores, NumaNode, expert_cores, numa_nodes, parse_cpulist,
                                          physical_cores)

GiB = 1 << 30


def fake_sysfs(root: Path, sockets: int, cores: int) -> tuple[Path, Path]:
    """(cpu root, node root) of a host with `sockets` sockets (one NUMA node each) of `cores` cores with two
    hyper-threads: logical CPU c and c + sockets * cores are siblings (Linux's numbering), 64 GiB a node."""
    cpu_root, node_root = root / "cpu", root / "node"
    n = sockets * cores
    for cpu in range(2 * n):
        core = cpu % n
        topo = cpu_root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{core // cores}\n")
        (topo / "core_id").write_text(f"{core % cores}\n")
    for s in range(sockets):
        d = node_root / f"node{s}"
        d.mkdir(parents=True)
        first = s * cores
        (d / "cpulist").write_text(f"{first}-{first + cores - 1},{n + first}-{n + first + cores - 1}\n")
        (d / "meminfo").write_text(f"Node {s} MemTotal:       {64 * GiB // 1024} kB\nNode {s} MemFree:  1 kB\n")
    (node_root / "possible").write_text(f"0-{sockets - 1}\n")  # not a node directory
    return cpu_root, node_root


def test_cpulist():
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("\n") == []


def test_two_sockets(tmp_path):
    cpu_root, node_root = fake_sysfs(tmp_path, sockets=2, cores=4)
    assert numa_nodes(node_root) == [NumaNode(0, (0, 1, 2, 3, 8, 9, 10, 11), 64 * GiB),
                                     NumaNode(1, (4, 5, 6, 7, 12, 13, 14, 15), 64 * GiB)]
    everything = list(range(16))
    assert physical_cores(cpu_root, everything) == list(range(8))  # the first sibling of each core
    cores = expert_cores(cpu_root, node_root, everything)
    assert cores == ExpertCores((0, 1, 2, 3), 0, 2) and cores.describe() == "NUMA node 0 of 2"
    # a process allowed more of node 1's cores: node 1's
    assert expert_cores(cpu_root, node_root, [3, 4, 5, 6, 13]) == ExpertCores((4, 5, 6), 1, 2)
    # allowed on one node only: no choice to make
    assert expert_cores(cpu_root, node_root, [4, 5, 12]) == ExpertCores((4, 5))


def test_one_socket_and_no_topology(tmp_path):
    cpu_root, node_root = fake_sysfs(tmp_path / "one", sockets=1, cores=4)
    cores = expert_cores(cpu_root, node_root, list(range(8)))
    assert cores == ExpertCores((0, 1, 2, 3)) and cores.describe() is None
    bare = tmp_path / "bare"
    assert numa_nodes(bare) == [] and expert_cores(bare, bare, [0, 1, 2]) == ExpertCores((0, 1, 2))


def test_placement_line_names_the_node():
    p = HybridPlacement.choose([0, 1, 2, 3], cpu_moe=True, threads=8, bits=4)
    line = p.describe("cuda", "bfloat16", cores="NUMA node 0 of 2")
    assert "8 CPU threads on NUMA node 0 of 2" in line
    assert "8 CPU threads," in p.describe("cuda", "bfloat16") and "NUMA" not in p.describe("cuda", "bfloat16")
