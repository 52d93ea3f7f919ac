"""Messages of device-side errors (megatron_mok/cuda/errors.py), decoded from the raw report
the kernels write: they must name the rank, the peer and what was awaited."""

from megatron_mok.cuda.errors import describe


def test_timeout_names_rank_peer_and_what():
    msg = describe([1, 0, 1, 1, 7, 0, 0, 0], timeout_s=2.0, max_recv_tokens=None)
    assert "rank 0 timed out after 2 s waiting for peer 1" in msg
    assert "routing" in msg and "did the peer call dispatch?" in msg
    assert "can no longer be used" in msg


def test_bad_expert_and_overflow_and_unknown():
    assert "flat slot 12" in describe([2, 1, -1, 0, 12, 0, 0, 0], 60.0, None)
    over = describe([3, 1, -1, 0, 5000, 0, 0, 0], 60.0, 4096)
    assert "received 5000 rows" in over and "max_recv_tokens=4096" in over
    assert "error code 9" in describe([9, 0, 0, 0, 0, 0, 0, 0], 60.0, None)


def test_detail_is_read_as_a_64_bit_value():
    # low word negative as int32 (bit 31 set), high word 1: detail = 2**32 + 2**31
    msg = describe([3, 0, -1, 0, -2**31, 1, 0, 0], 60.0, 8)
    assert f"received {2**32 + 2**31} rows" in msg


def test_speculative_mismatch_names_the_setting():
    msg = describe([5, 2, 0, 0, 0, 0, 0, 0], 60.0, None)
    assert "rank 2 and rank 0 disagree on the speculative eager dispatch" in msg
    assert "MOK_EAGER_SPECULATIVE=1" in msg and "MOK_EAGER_STAGE_FIRST" in msg
    assert "can no longer be used" in msg


def test_timeout_names_the_other_waits_the_rank_gave_up():
    from megatron_mok.cuda.errors import abandoned_waits
    # The report's table: kind 4 (a producer waiting for peer 3 to release generation 703)
    # and kind 3 (the first timeout itself, also noted); 4 int32 words per kind.
    table = [0] * 32
    table[4 * 4: 4 * 4 + 4] = [3, 0, 703, 0]
    table[4 * 3: 4 * 3 + 4] = [1, 0, 701, 0]
    report = [1, 0, 1, 3, 701, 0, (1 << 3) | (1 << 4), 0]
    waits = abandoned_waits(report, table)
    assert waits == [(3, 1, 701), (4, 3, 703)]
    msg = describe(report, 30.0, None, waits)
    assert "waiting for peer 1: the peer's staged tokens (dispatch ring chunk) (detail 701)" in msg
    assert "Also stopped on this rank, still waiting: peers to release this rank's dispatch ring " \
           "slot from peer 3 (detail 703)." in msg
    assert "Also stopped" not in describe([1, 0, 1, 3, 701, 0, 0, 0], 30.0, None, [(3, 1, 701)])
    # a 64-bit detail survives the two words
    assert abandoned_waits([1, 0, 0, 0, 0, 0, 1 << 6, 0], [0] * 24 + [2, 0, -1, 1]) == \
        [(6, 2, (1 << 32) | 0xFFFFFFFF)]
    # waits_noted is read unsigned: a high-word bit (no kind uses it) must not turn into a
    # negative mask with every low bit set
    assert abandoned_waits([1, 0, 0, 0, 0, 0, 0, -2**31], [0] * 32) == []


def test_peer_stopped_names_both_ranks_and_the_generation():
    # kPeerStopped (config.h): the reader found the source's slot poisoned (NOTES item 37, B1)
    msg = describe([7, 1, 0, 3, 42, 0, 0, 0], 60.0, None)
    assert "rank 1: rank 0 stopped after an error of its own" in msg
    assert "generation 42" in msg and "not valid" in msg and "can no longer be used" in msg


def test_peer_stopped_found_at_the_release_says_the_rows_were_being_read():
    # NOTES item 41: the re-read before a copy-engine-staged call's release reports kPeerStopped
    # with `what` = the release's wait kind: the rows were read, and may have been overwritten.
    from megatron_mok.cuda.errors import PEER_STOPPED_WHILE_READ
    msg = describe([7, 1, 0, PEER_STOPPED_WHILE_READ, 42, 0, 0, 0], 60.0, None)
    assert "rank 1: rank 0 stopped after an error of its own" in msg
    assert "while this rank was reading" in msg and "under this rank's reads" in msg
    assert "generation 42" in msg and "not valid" in msg and "can no longer be used" in msg
    assert "did not read them" not in msg
    assert "did not read them" in describe([7, 1, 0, 3, 42, 0, 0, 0], 60.0, None)
