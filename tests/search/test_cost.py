"""The cost model's formulas against hand-computed numbers, and the cluster's flags."""

import pytest

from autoshard.cli.main import main
from autoshard.cost.cluster import device_kind, make_cluster
from autoshard.cost.devices import DEVICES
from autoshard.cost.liveness import shard_bytes
from autoshard.cost.price import collective_time
from autoshard.document.plan_document import read_document
from autoshard.errors import ClusterError
from autoshard.explain.report import plan_markdown
from autoshard.mesh import Mesh
from autoshard.reshard import plan_reshard
from autoshard.sharding import Sharding
from autoshard.units import parse_bandwidth, parse_size
from tests.search.test_plan import MODELS

S = Sharding.parse
CLUSTER = make_cluster(mesh="4x8", bandwidth="25GB/s,450GB/s", latency="5us,1us")


def only(src, dst, shape, mesh=CLUSTER.mesh):
    (collective,) = plan_reshard(S(src), S(dst), shape, mesh)
    return collective


def test_all_gather_over_the_slow_axis():
    """1024x1024 float32 split 4 ways on axis 0: local 1 MiB; an all_gather sends (n-1) local
    shards = 3 MiB over 25 GB/s in 3 steps of 5 us."""
    c = only("[[0]]", "[[]]", (1024, 1024))
    assert c.bytes_per_device == 3 * 2**20
    assert collective_time(c, CLUSTER) == pytest.approx(3 * 5e-6 + 3 * 2**20 / 25e9)


def test_all_reduce_over_the_fast_axis():
    """A partial sum over axis 1 (8 devices) of a 4 MiB tensor: 2 (n-1)/n T = 7 MiB in 14
    steps of 1 us at 450 GB/s."""
    c = only("[[]] partial = sum[1]", "[[]]", (1024, 1024))
    assert c.bytes_per_device == 2 * 7 * 2**19
    assert collective_time(c, CLUSTER) == pytest.approx(14e-6 + 7 * 2**20 / 450e9)


def test_a_group_over_both_axes_runs_in_two_stages():
    """all_gather over [0, 1] (32 devices, 8 in each of 4 nodes): 31 local shards of 128 KiB.
    The ring (31 steps of 5 us, at min(450, 8 x 25) GB/s) takes 175 us; the two stages, 3 of
    the shards across nodes at 25 GB/s in 3 steps of 5 us, then 28 in the node at 450 GB/s in
    7 steps of 1 us, take 46 us: small messages go the hierarchical way."""
    c = only("[[0, 1]]", "[[]]", (1024, 1024))
    assert c.bytes_per_device == 31 * 2**17
    ring = 31 * 5e-6 + 31 * 2**17 / 200e9
    staged = 3 * 5e-6 + 7 * 1e-6 + 3 * 2**17 / 25e9 + 28 * 2**17 / 450e9
    assert staged < ring
    assert collective_time(c, CLUSTER) == pytest.approx(staged)


def test_reduce_scatter_and_all_to_all():
    rs = only("[[]] partial = sum[1]", "[[1]]", (1024, 1024))
    assert rs.bytes_per_device == 7 * 2**19  # (n-1)/n of 4 MiB
    assert collective_time(rs, CLUSTER) == pytest.approx(7e-6 + 7 * 2**19 / 450e9)
    a2a = only("[[1]]", "[[], [1]]", (1024, 1024))
    assert a2a.bytes_per_device == 7 * 2**16  # (n-1)/n of the 512 KiB shard
    assert collective_time(a2a, CLUSTER) == pytest.approx(7e-6 + 7 * 2**16 / 450e9)


def test_a_local_slice_is_free():
    c = only("[[]]", "[[0, 1]]", (1024, 1024))
    assert (c.bytes_per_device, collective_time(c, CLUSTER)) == (0, 0.0)


def test_shard_bytes_take_the_largest_shard():
    """10 rows over 4 devices: shards of 3, 3, 3, 1 rows; float16 rows of 6 elements."""
    assert shard_bytes((10, 6), "float16", S("[[0]]"), Mesh((4, 8))) == 3 * 6 * 2


@pytest.mark.parametrize(
    "text, expected",
    [("16GiB", 16 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1e9", 10**9)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_bandwidth_units():
    assert parse_bandwidth("450GB/s") == 450e9
    assert parse_bandwidth("100Gbit/s") == 100e9 / 8


@pytest.mark.parametrize(
    "mesh, flags, bandwidth, latency",
    [
        ("4x8", {}, (50e9, 450e9), (5e-6, 1e-6)),  # 4 DGX H100 nodes of 8: NIC, then NVLink
        ("2x4", {}, (450e9, 450e9), (1e-6, 1e-6)),  # 8 devices: one node
        ("16", {}, (50e9,), (5e-6,)),  # a ring over two nodes runs at the network's speed
        ("2x4x8", {}, (50e9, 50e9, 450e9), (5e-6, 5e-6, 1e-6)),
        ("2x2x2", {}, (450e9,) * 3, (1e-6,) * 3),
        ("4x8", {"file": "dgx-a100"}, (25e9, 300e9), (5e-6, 1e-6)),  # preset: HDR 200G NICs
        ("4x8", {"device": "tpu-v5e"}, (200e9, 200e9), (1e-6, 1e-6)),  # a 256-chip ICI pod
        ("4x8", {"bandwidth": "100GB/s"}, (100e9, 100e9), (5e-6, 1e-6)),  # flags override
        ("4x8", {"latency": "3us,2us"}, (50e9, 450e9), (3e-6, 2e-6)),
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_default_links_follow_the_nodes(mesh, flags, bandwidth, latency):
    """The last axis is the scale-up domain while the devices inside fit one node (8 on a DGX);
    outer axes run on the network."""
    cluster = make_cluster(mesh=mesh, **flags)
    assert (cluster.bandwidth, cluster.latency) == (bandwidth, latency)


def test_a_dgx_h100_prices_axis_0_on_the_network_and_axis_1_on_nvlink():
    """4x8 on the dgx-h100 preset, 1024x1024 float32: an all_gather of 1 MiB shards over axis
    0 (4 nodes) sends 3 MiB at 50 GB/s in 3 steps of 5 us; over axis 1 (8 GPUs of a node) 7
    shards of 512 KiB at 450 GB/s in 7 steps of 1 us."""
    dgx = make_cluster(mesh="4x8", file="dgx-h100")
    outer = only("[[0]]", "[[]]", (1024, 1024))
    inner = only("[[1]]", "[[]]", (1024, 1024))
    assert collective_time(outer, dgx) == pytest.approx(3 * 5e-6 + 3 * 2**20 / 50e9)
    assert collective_time(inner, dgx) == pytest.approx(7 * 1e-6 + 7 * 2**19 / 450e9)
    assert dgx.describe_links() == [
        "axis 0 (4): 50 GB/s, 5 us (network across nodes)",
        "axis 1 (8): 450 GB/s, 1 us (NVLink in a node)",
    ]


def test_presets_and_defaults():
    cluster = make_cluster(mesh="2x4", device="a100")
    # 80 GB less 1 GiB of CUDA context, 0.5 GiB of NCCL buffers and 1 % for fragmentation
    assert cluster.reserve == 2**30 + 2**29 + 8 * 10**8
    assert cluster.memory == 80 * 10**9 - cluster.reserve
    assert cluster.bandwidth == (300e9, 300e9)  # 8 devices: one DGX A100 node
    assert cluster.device.hbm_bandwidth == 2.039e12
    assert cluster.device.peak("bfloat16") == 312e12
    assert cluster.device.peak("float32") == 19.5e12


def test_cluster_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("mesh: 4x8\nbandwidth: [25GB/s, 450GB/s]\nlatency: 2us\ndevice: mi300x\n")
    cluster = make_cluster(file=path, memory="64GiB")
    assert (cluster.bandwidth, cluster.latency) == ((25e9, 450e9), (2e-6, 2e-6))
    assert cluster.memory == 64 * 2**30 and cluster.device.name == "AMD Instinct MI300X"
    assert cluster.reserve == 0  # a budget given is the tensors' budget


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"mesh": "4x8", "bandwidth": "1GB/s,2GB/s,3GB/s"}, "3 bandwidth values for a mesh of 2"),
        ({"mesh": "4x8", "device": "tpu9"}, "unknown device 'tpu9'; presets: a100, h100"),
        ({"mesh": "4x8", "memory": "lots"}, "memory 'lots' is not a size like 16GiB"),
        ({"mesh": "4x8", "latency": "5 parsecs"}, "latency '5 parsecs' is not like 5us"),
        ({}, "no mesh: give --mesh"),
    ],
)
def test_bad_cluster_flags(flags, message):
    with pytest.raises(ClusterError, match=message.replace("(", r"\(")):
        make_cluster(**flags)


def test_the_budget_states_its_reserve():
    """No --memory: 80 GB less 2410612736 B of reserve = 77589387264 B; a --memory given is the
    tensors' budget, with nothing held back."""
    cluster = make_cluster(mesh="4x8")
    assert (cluster.memory, cluster.reserve) == (77589387264, 2410612736)
    assert cluster.describe_budget() == (
        "memory budget 72.26 GiB per device (74.51 GiB - 2.25 GiB reserve: CUDA context, "
        "NCCL buffers, allocator fragmentation)"
    )
    assert cluster.to_json()["reserve_bytes"] == 2410612736
    given = make_cluster(mesh="4x8", memory="16GiB")
    assert (given.memory, given.reserve) == (16 * 2**30, 0)
    assert given.describe_budget() == "memory budget 16.00 GiB per device"


@pytest.mark.parametrize(
    "preset, device, memory, network",
    [
        ("selene", "NVIDIA A100 SXM4 80GB", 80 * 10**9, 25e9),  # 8 HDR 200 Gb/s NICs a node
        ("grand-teton-h100", "NVIDIA H100 HBM2e 96GB 500W", 96 * 10**9, 50e9),  # 400 Gb/s a GPU
        ("dgx-h100", "NVIDIA H100 SXM5 80GB", 80 * 10**9, 50e9),
    ],
)
def test_presets_of_published_runs(preset, device, memory, network):
    cluster = make_cluster(mesh="4x8", file=preset)
    assert cluster.device.name == device and cluster.device.memory == memory
    assert cluster.bandwidth[0] == network and cluster.device.node_size == 8
    assert cluster.memory == memory - (2**30 + 2**29 + memory // 100)


def test_the_grand_teton_h100_is_the_sxm5_less_an_eighth():
    """TorchTitan's H100s: no published peak; the SXM5's less 12.5 %, HBM2e at 2.4 TB/s."""
    sxm, teton = DEVICES["h100"], DEVICES["h100-hbm2e"]
    for dtype in ("bfloat16", "float8_e4m3fn"):
        assert teton.peak(dtype) == pytest.approx(0.875 * sxm.peak(dtype), rel=1e-3)
    assert teton.hbm_bandwidth == 2.4e12


def test_a_described_device_takes_a_reserve():
    spec = {"name": "mine", "flops": {"bfloat16": 1e15}, "default_flops": 5e13,
            "memory": 10**10, "link_bandwidth": 1e11, "hbm_bandwidth": 1e12,
            "reserve": 10**9}  # fmt: skip
    assert device_kind(spec).reserve == 10**9
    with pytest.raises(ClusterError, match="times >= 0"):
        device_kind({**spec, "reserve": -1})


def test_the_summary_states_the_reserve(capsys, tmp_path):
    """`autoshard plan` without --memory says what the budget held back, and so do the plan
    document and its report; with --memory, nothing is held back."""
    args = ["plan", str(MODELS / "mlp.onnx"), "--mesh", "2", "--dim", "batch=8", "-q"]
    assert main([*args, "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert " of 72.26 GiB (0.0%); memory budget 72.26 GiB per device (74.51 GiB - 2.25 GiB " in out
    document = read_document(tmp_path / "plan.json")
    assert document.cluster is not None and document.cluster.reserve_bytes == 2410612736
    assert "of 72.26 GiB (0.0%); the device's memory less a reserve of 2.25 GiB" in (
        plan_markdown(document)
    )
    assert main([*args, "--memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert " of 1.00 GiB (" in out and "reserve" not in out
