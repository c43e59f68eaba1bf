"""bench/hosts_compare.py's use of the link by the large all-reduces, worked out from made-up
figures: the bytes each host must move, the rate and its shares of the two link figures, the sizes
left out, and the table's cells. No hosts are made here (test_hosts_compare.py runs the script).
"""

from __future__ import annotations

import pytest

from shmcoll.bench.adapters import OPENMPI

from harness import load_bench_script

load_bench_script("hosts_rank")  # hosts_compare imports it
hosts_compare = load_bench_script("hosts_compare")
HIER = hosts_compare.HIER
MIB = 1 << 20
LINK = {"both": [{"gbps": 3.0}, {"gbps": 2.0}],
        "both_data_sized": {"streams": [{"gbps": 2.5}, {"gbps": 1.5}]}}


@pytest.mark.parametrize("hosts, share", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_each_host_must_move_two_host_fractions_of_the_array(hosts, share):
    assert hosts_compare.crossing_bytes(hosts, 64 * MIB) == share * 64 * MIB


def test_the_rate_and_its_shares_of_both_link_figures():
    """2 hosts x 1, 64 MiB in 32 ms: 64 MiB each way, 2.10 GB/s; the link both ways from a hot MiB
    is 2.5 GB/s on the mean of its directions, through 64 MiB arrays 2.0."""
    layouts = [hosts_compare.Layout(2, 1), hosts_compare.Layout(4, 1)]
    rows = {"2x1": [{"size": MIB, HIER: 500.0, OPENMPI: 600.0},
                    {"size": 64 * MIB, HIER: 32000.0, OPENMPI: 64000.0}],
            "4x1": [{"size": 16 * MIB, HIER: 25000.0, OPENMPI: None}]}
    uses = hosts_compare.link_use(layouts, rows, LINK)
    assert [(u["layout"], u["size"]) for u in uses] == [("2x1", 64 * MIB), ("4x1", 16 * MIB)]
    ours = uses[0][HIER]
    assert ours["gbps"] == pytest.approx(64 * MIB / 32e-3 / 1e9)
    assert ours["of_hot"] == pytest.approx(ours["gbps"] / 2.5) and ours["of_data"] == pytest.approx(ours["gbps"] / 2.0)
    assert uses[0][OPENMPI]["gbps"] == pytest.approx(ours["gbps"] / 2)
    assert uses[1][HIER]["gbps"] == pytest.approx(1.5 * 16 * MIB / 25e-3 / 1e9)
    assert uses[1][OPENMPI] == {"gbps": None, "of_hot": None, "of_data": None}
    lines = hosts_compare.link_use_lines(uses)
    assert "| 2x1 | 64 MiB | 2.10 GB/s (84% / 105%) | 1.05 GB/s (42% / 52%) |" in lines
    assert "| 4x1 | 16 MiB | 1.01 GB/s (40% / 50%) | - |" in lines


def test_a_failed_link_figure_leaves_the_shares_out_and_small_runs_print_nothing():
    link = {"both": [{"gbps": None}, {"gbps": 2.0}], "both_data_sized": {"streams": [{"gbps": 2.0}, {"gbps": 2.0}]}}
    rows = {"2x1": [{"size": 16 * MIB, HIER: 8000.0, OPENMPI: 9000.0}]}
    use = hosts_compare.link_use([hosts_compare.Layout(2, 1)], rows, link)[0][HIER]
    assert use["of_hot"] is None and use["of_data"] == pytest.approx(use["gbps"] / 2.0)
    small = {"2x1": [{"size": 8, HIER: 40.0, OPENMPI: 20.0}]}
    assert hosts_compare.link_use_lines(hosts_compare.link_use([hosts_compare.Layout(2, 1)], small, LINK)) == []
