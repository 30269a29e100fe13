"""``nvidia-smi topo -m`` read into how each pair of GPUs is connected (for ``moeserve env``)."""
from moeserve.hardware import describe_link, parse_topology

TOPO = ("\x1b[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tSYS\tSYS\t0-31\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tPHB\tSYS\t0-31\t0\t\tN/A\n"
        "GPU2\tSYS\tPHB\t X \tSYS\t32-63\t1\t\tN/A\n"
        "NIC0\tSYS\tSYS\tSYS\t X \n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n")


def test_topology_matrix():
    links = parse_topology(TOPO)
    assert links[(0, 1)] == links[(1, 0)] == "NV18"
    assert links[(1, 2)] == "PHB" and links[(0, 2)] == "SYS"
    assert (0, 0) not in links and len(links) == 6
    assert describe_link("NV18") == "NVLink (18 links)"
    assert describe_link("PHB") == "PCIe, host bridge"
    assert parse_topology("No devices were found") == {}


def test_env_report_names_the_collectives():
    from moeserve.config import make_config
    from moeserve.tools.env_report import env_report
    one = env_report(make_config(device="cpu"))["parallel"]
    assert one == {"ranks": 1, "collectives": [], "tensor_parallel_size": 1, "enable_expert_parallel": False}
    par = env_report(make_config(device="cpu", tensor_parallel_size=2, enable_expert_parallel=True,
                                 expert_parallel_dispatch="allgather_reducescatter"))["parallel"]
    assert par["backend"] == "gloo" and par["ranks"] == 2
    assert any("all-gather of hidden states" in c for c in par["collectives"])
