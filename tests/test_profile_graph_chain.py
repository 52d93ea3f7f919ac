"""CPU checks of scripts/profile_graph_chain.py's helpers: settings parsing and kernel gaps."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import profile_graph_chain as pgc  # noqa: E402


def test_settings_parse_into_environment_dicts():
    assert pgc.parse_settings("MOK_PDL=1;MOK_PDL=0") == [{"MOK_PDL": "1"}, {"MOK_PDL": "0"}]
    assert pgc.parse_settings("A=1, B=x=y;;") == [{"A": "1", "B": "x=y"}, {}, {}]
    assert pgc.label({}) == "defaults" and pgc.label({"B": "2", "A": "1"}) == "A=1,B=2"
    with pytest.raises(ValueError, match="VAR=value"):
        pgc.parse_settings("MOK_PDL")


def test_kernel_gaps_per_boundary_in_start_order():
    # Two chains a -> b -> c, given out of order; b overlaps a in the second (a PDL launch).
    ks = [("b", 12.0, 20.0), ("a", 0.0, 10.0), ("c", 23.0, 30.0),
          ("a", 31.0, 40.0), ("b", 39.0, 45.0), ("c", 46.0, 50.0)]
    g = pgc.kernel_gaps(ks)
    assert set(g) == {"a -> b", "b -> c", "c -> a"}
    assert g["a -> b"] == {"gap_us": 0.5, "start_to_start_us": 10.0, "count": 2}   # gaps 2, -1
    assert g["b -> c"]["gap_us"] == 2.0 and g["b -> c"]["count"] == 2              # gaps 3, 1
    assert g["c -> a"] == {"gap_us": 1.0, "start_to_start_us": 8.0, "count": 1}


def test_kernel_names_are_shortened_to_the_function():
    assert pgc._short("void mok::(anonymous namespace)::fill_kernel(mok::CommContext, int)") == "fill_kernel"
    assert pgc._short("void mok::(anonymous namespace)::combine_transfer_kernel<__nv_bfloat16, float, 2>(x)") \
        == "combine_transfer_kernel"
