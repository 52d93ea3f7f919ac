"""The launch rules of a CUDA Buffer (megatron_mok/cuda/launch_policy.py), on any machine: when
kernels use programmatic dependent launch and when small calls get their own SM budget."""

import pytest

from megatron_mok.cuda.launch_policy import DEFAULT_SMALL_CALL_SMS, DEFAULT_SMALL_CALL_TOKENS, launch_policy


def test_defaults_one_rank_per_gpu():
    p = launch_policy({}, None, shares_gpu=False)
    assert p.pdl and (p.small_call_sms, p.small_call_tokens) == (DEFAULT_SMALL_CALL_SMS, DEFAULT_SMALL_CALL_TOKENS)
    assert (DEFAULT_SMALL_CALL_SMS, DEFAULT_SMALL_CALL_TOKENS) == (64, 1024)


def test_num_sms_given_holds_for_every_call():
    p = launch_policy({}, 24, shares_gpu=False)
    assert p.pdl and (p.small_call_sms, p.small_call_tokens) == (0, -1)
    # ... unless the small-call budget is asked for explicitly.
    p = launch_policy({"MOK_SMALL_CALL_SMS": "48"}, 24, shares_gpu=False)
    assert (p.small_call_sms, p.small_call_tokens) == (48, 1024)


def test_ranks_sharing_a_gpu_launch_plainly_on_their_share():
    p = launch_policy({}, None, shares_gpu=True)
    assert not p.pdl and (p.small_call_sms, p.small_call_tokens) == (0, -1)
    p = launch_policy({"MOK_PDL": "1", "MOK_SMALL_CALL_SMS": "8"}, None, shares_gpu=True)
    assert p.pdl and (p.small_call_sms, p.small_call_tokens) == (8, 1024)


@pytest.mark.parametrize("env, pdl, small, tokens", [
    ({"MOK_PDL": "0"}, False, 64, 1024),
    ({"MOK_PDL": ""}, True, 64, 1024),                 # empty = unset
    ({"MOK_SMALL_CALL_SMS": "0"}, True, 0, -1),
    ({"MOK_SMALL_CALL_SMS": "-3"}, True, 0, -1),       # negative = off, not a negative grid
    ({"MOK_SMALL_CALL_TOKENS": "300"}, True, 64, 300),
    ({"MOK_SMALL_CALL_SMS": "0", "MOK_SMALL_CALL_TOKENS": "300"}, True, 0, -1),
])
def test_environment_overrides(env, pdl, small, tokens):
    p = launch_policy(env, None, shares_gpu=False)
    assert (p.pdl, p.small_call_sms, p.small_call_tokens) == (pdl, small, tokens)


def test_a_malformed_number_is_an_error_not_a_silent_default():
    with pytest.raises(ValueError):
        launch_policy({"MOK_SMALL_CALL_SMS": "many"}, None, shares_gpu=False)
