// Included only from kernels/combine_transfer.cu; uses shape.cuh, partials.cuh, row_stream.cuh.
// Holds the consumer warps: consume, consume_staged and consume_any.
#pragma once

namespace mok {
namespace {

// Consumer warps: my tokens t = warp, warp + n_warps, ... Each token is summed in steps of
// U x 256 elements per warp (S steps per token; a "piece" is one step of one token). Every
// piece's own expert rows and its first remote partial are copied into the warp's ring of
// shared-memory slots with 16-byte cp.async, as many pieces ahead as the ring holds (one
// commit group per piece), so the SM keeps ~14 KB per warp in flight instead of the two rows
// a lane's registers hold. A partial is streamed only if its chunk is ready when its token's
// first piece is issued: the stream never WAITS, since this warp has not yet released the
// chunks of the tokens before it, and a producer may be waiting for exactly those slots
// (small rings). Unstreamed partials, partials of further ranks (world > 2) and the own rows
// of tokens with more than kMaxOwn of them are loaded when summed.
template <typename T, typename P, int kOwnRows, bool kSplit>
__device__ void consume(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const CombineShape& sh, const Role& role, const T* expert_out,
                        const float* grad_probs, T* y, float* grad_w, int4* smem) {
  using RS = RowStream<T, P>;
  // MOK_CONSUME_CLOCKS builds: this warp's cycles by kind (ConsumeClock; compiled out otherwise).
  [[maybe_unused]] long long clk[kCClockKinds] = {}, clk0 = 0, clk_t = 0;
  [[maybe_unused]] auto tick = [&](int kind) {
    if constexpr (kConsumeClocks) {
      const long long now = clock64();
      clk[kind] += now - clk_t;
      clk_t = now;
    }
  };
  if constexpr (kConsumeClocks) clk0 = clock64();
  constexpr int Uc = kConsumeUnroll;  // groups per piece (NOTES next experiment (A))
  constexpr int R = RS::kSlots;
  constexpr int kStepElems = kWarpSize * kCombineVec * Uc;
  const int lane = threadIdx.x % kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  const int n_warps = role.count * warps_per_block;
  // Warps numbered across blocks first (block b's warp w is w * blocks + b), so a call with
  // fewer tokens than warps still spreads over every SM of the role.
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * role.count + role.index();
  const int W = c.world, me = c.rank;
  const int my_first_task = h.task_off[me];
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  // Fewer tokens than warps: a token's S steps are dealt to P warps (warp w: part w / n_my
  // of token w % n_my, at most one item per warp). Every part waits for the token's partials and
  // sums its own steps in the same order, so the result does not depend on P.
  const int n_my = a.num_tokens;
  const int Pc = kSplit ? split_factor(sh, n_warps, n_my, S) : 1;
  int first_step = 0, n_steps = S;
  if (Pc > 1) part_steps(S, Pc, warp / n_my, first_step, n_steps);
  int n_tok = Pc > 1 ? (warp < n_my * Pc ? 1 : 0)
                     : (n_my > warp ? (n_my - warp + n_warps - 1) / n_warps : 0);
  // Phased calls: a warp's tokens are a run of consecutive ones (the first n_my % n_warps warps
  // one more), so their partials share ring chunks and one ready-flag check over NVLink covers
  // ~10 tokens instead of one per token (every n_warps-th token is ~6 chunks further:
  // benchmarks/NOTES.md #33). The role split keeps the strided order, whose warps all move
  // through the chunks in order (the progress argument of a ring smaller than a call).
  int first_tok = warp, tok_stride = n_warps;
  if (Pc == 1 && sh.token_runs) {
    const int base = n_my / n_warps, extra = n_my % n_warps;
    n_tok = base + (warp < extra ? 1 : 0);
    first_tok = warp * base + min(warp, extra);
    tok_stride = 1;
  }
  auto token_of = [&](int k) { return Pc > 1 ? warp % n_my : first_tok + k * tok_stride; };
  const WarpRing<T, P> ring(smem);
  constexpr unsigned kGroupBytes = WarpRing<T, P>::kGroupBytes;
  auto rows_of = [&](int t) -> const int32_t* {
    const int q = h.send_index(c.ws.cfg, t, me);
    return q < 0 ? nullptr : h.task_rows + static_cast<size_t>(my_first_task + q) * sh.K;
  };
  SeenGens seen;

  // ---- issue side: the next piece is token iss_k's step iss_st (counters, not a piece index
  // / n_steps: a 64-bit division per piece was a subroutine call, NOTES.md #22); the
  // ring's free slots start at address iaddr.
  int ahead = 0, iss_k = 0, iss_st = first_step;  // ahead: pieces issued and not yet summed
  unsigned iaddr = ring.begin;
  int free_slots = R;
  int ik = -1;                 // token whose plan is below
  int irow = -1;               // lane r: token ik's own row r
  unsigned long long ibase = 0; // lane r: the address of that row (a copy is then a shuffle and an add)
  int in_own = 0;              // own rows streamed for token ik (0 when summed directly)
  const P* ipartial = nullptr; // token ik's streamed partial, or null
  uint64_t streamed = 0;       // bit k % 64: token k's first remote partial is streamed
  int ck = 0;                  // the token being consumed
  auto try_issue = [&]() {
    while (n_steps > 0 && iss_k < n_tok) {
      const int k = iss_k, st = iss_st;
      // Pieces that need no slot (no own rows here, partial not ready) cost nothing, so
      // bound the look-ahead in tokens too: `streamed` keeps 64 tokens' bits.
      if (k - ck >= 32) return;
      if (k != ik) {  // plan the token once, when its first piece comes up
        ik = k;
        const int t = token_of(k);
        const int n = sh.stream_own ? stream_rows<RS::kMaxOwn>(rows_of(t), sh.K, a.row_cap, irow) : -1;
        ibase = irow >= 0 ? reinterpret_cast<unsigned long long>(expert_out + static_cast<size_t>(irow) * sh.H) : 0;
        in_own = n < 0 ? 0 : n;
        ipartial = nullptr;
        streamed &= ~(1ull << (k % 64));
        const int d0 = first_remote(c, h, t);
        if (d0 >= 0) {
          const int q = h.send_index(c.ws.cfg, t, d0);
          const uint64_t g = sh.gen(me, q / sh.C);
          const uint64_t* flag = RingView::combine(c.ws, c.peers.base[d0]).ready + sh.slot(me, q / sh.C);
          // Every lane acquires the flag itself before reading the data it guards. Not
          // seen.set: the cache may only record chunks checked in token order. A poisoned slot
          // (its rank stopped) is not streamed: the token's plan waits for it and reports it.
          if (seen.has(d0, g) || __all_sync(0xffffffffu, is_published(ld_acquire_sys(flag), g + 1))) {
            ipartial = remote_partial<P>(c, sh, d0, q);
            streamed |= 1ull << (k % 64);
          }
        }
      }
      const int need = in_own + (ipartial != nullptr ? 1 : 0);
      if (need > free_slots) return;
      const int v0 = st * kStepElems + lane * kCombineVec;
      const unsigned dst = ring.copy_rows(iaddr, ibase, in_own, v0, sh.H);
      if (ipartial != nullptr)
#pragma unroll
        for (int u = 0; u < Uc; ++u) {
          const int4* src = reinterpret_cast<const int4*>(ipartial + v0 + u * kWarpSize * kCombineVec);
#pragma unroll
          for (int w = 0; w < Raw8<P>::kVecs; ++w)
            cp_async_16_shared_if(dst + u * kGroupBytes + 16 * w, src + w, group_live(v0, u, sh.H));
        }
      cp_async_commit();
      iaddr = ring.next(iaddr, need);
      free_slots -= need;
      ++ahead;
      if (++iss_st == first_step + n_steps) {
        iss_st = first_step;
        ++iss_k;
      }
    }
  };
  try_issue();

  // ---- consume side
  unsigned caddr = ring.begin;  // the next piece's first slot
  for (int k = 0; k < n_tok; ++k) {
    if constexpr (kConsumeClocks) clk_t = clock64();
    ck = k;
    const int t = token_of(k);
    // q of t for rank d (index among my tokens sent to d), or -1: read where needed (L1 hits).
    auto pos = [&](int d) { return h.send_index(c.ws.cfg, t, d); };
    const int32_t* my_rows = rows_of(t);
    const int my_task = my_rows != nullptr ? my_first_task + pos(me) : -1;
    int lane_row;
    // Own rows streamed (their count), or -1: loaded straight into registers when summed (more
    // than kMaxOwn of them, or MOK_COMBINE_STREAM_OWN=0).
    const int n_own = sh.stream_own ? stream_rows<RS::kMaxOwn>(my_rows, sh.K, a.row_cap, lane_row)
                                    : (my_rows != nullptr ? -1 : 0);
    const int own_slots = n_own < 0 ? 0 : n_own;
    tick(kCClockTokenSetup);
    if (!wait_token_partials(c, h, sh, seen, t)) { cp_async_wait<0>(); return; }
    tick(kCClockPartialWait);
    // The streamed rank, or -1 when t's first remote partial was not ready in time (then it is
    // loaded like any further rank's).
    const int d0 = (streamed >> (k % 64)) & 1 ? first_remote(c, h, t) : -1;
    const int need = own_slots + (d0 >= 0 ? 1 : 0);
    // Lane d < W holds q of t for rank d and, for a remote rank, where its partial is staged,
    // so the steps below neither re-read the handle nor recompute slots (up to 32 ranks; a
    // wider world reads them per step).
    const bool lane_cache = W <= kWarpSize;
    int lane_q = -1;
    unsigned long long lane_src = 0;
    if (lane_cache && lane < W) {
      lane_q = pos(lane);
      if (lane_q >= 0 && lane != me)
        lane_src = reinterpret_cast<unsigned long long>(remote_partial<P>(c, sh, lane, lane_q));
    }
    const unsigned holders = __ballot_sync(0xffffffffu, lane_q >= 0);
    for (int st = first_step; st < first_step + n_steps; ++st) {
      const int v0 = st * kStepElems + lane * kCombineVec;
      tick(kCClockTokenSetup);                  // the lane cache above / the loop (first piece)
      try_issue();                              // this piece is issued (the ring is free by now)
      tick(kCClockIssue);
      cp_async_wait_at_most(ahead - 1);         // it has landed; later ones may be in flight
      tick(kCClockCopyWait);
      --ahead;
      // My own partial: my rows summed here (same rows, order and rounding as a producer).
      float part[Uc][kCombineVec], acc[Uc][kCombineVec];
      zero(part);
      unsigned src = caddr;
      if (n_own > 0) {
        src = ring.sum_rows(part, caddr, n_own);
      } else if (n_own < 0) {
        sum_rows<T, kOwnRows>(part, expert_out, my_rows, sh.K, a.row_cap, v0, sh.H);
      }
      if (my_rows != nullptr) {
#pragma unroll
        for (int u = 0; u < Uc; ++u)
#pragma unroll
          for (int e = 0; e < kCombineVec; ++e) part[u][e] = round_to<P>(part[u][e]);
      }
      if constexpr (kConsumeClocks) {  // the sums have landed once a register of each is read
        float sink = 0.f;
#pragma unroll
        for (int u = 0; u < Uc; ++u) sink += part[u][0];
        asm volatile("" ::"f"(sink));
      }
      tick(kCClockOwnSum);
      // Sum in rank order.
      zero(acc);
      auto add_rank = [&](int d) {
        if (d == me) {
#pragma unroll
          for (int u = 0; u < Uc; ++u)
#pragma unroll
            for (int e = 0; e < kCombineVec; ++e) acc[u][e] += part[u][e];
        } else if (d == d0) {  // its slot follows the own rows' (src)
#pragma unroll
          for (int u = 0; u < Uc; ++u) {
            Raw8<P> r;
            load_raw_shared(r, src + u * kGroupBytes);
            add_raw<P>(acc[u], r);
          }
        } else {
          const P* src = lane_cache ? reinterpret_cast<const P*>(__shfl_sync(0xffffffffu, lane_src, d))
                                    : remote_partial<P>(c, sh, d, pos(d));
          Raw8<P> r[Uc];
#pragma unroll
          for (int u = 0; u < Uc; ++u)
            if (group_live(v0, u, sh.H)) load_raw(r[u], src + v0 + u * kWarpSize * kCombineVec);
#pragma unroll
          for (int u = 0; u < Uc; ++u)
            if (group_live(v0, u, sh.H)) add_raw<P>(acc[u], r[u]);
        }
      };
      if (lane_cache) {
        for (unsigned m = holders; m != 0; m &= m - 1) add_rank(__ffs(m) - 1);  // ascending ranks
      } else {
        for (int d = 0; d < W; ++d)
          if (pos(d) >= 0) add_rank(d);
      }
#pragma unroll
      for (int u = 0; u < Uc; ++u)
        if (group_live(v0, u, sh.H))
          Vec8<T>::store(y + static_cast<size_t>(t) * sh.H + v0 + u * kWarpSize * kCombineVec, acc[u]);
      // The piece's slots were read above: hand them to the pieces ahead.
      caddr = ring.next(caddr, need);
      free_slots += need;
      tick(kCClockRankSum);
    }
    if (grad_w != nullptr && first_step == 0 && lane < sh.K) {  // part 0 writes the prob gradients
      float val = 0.f;
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0) continue;
        float part = 0.f;
        if (d == me) {
          for (int k = 0; k < sh.K; ++k) {
            const int row = my_rows[k];
            if (row < 0) break;
            if (h.task_k[static_cast<size_t>(my_task) * sh.K + k] == lane && row < a.row_cap)
              part = grad_probs[row];
          }
        } else {
          part = partial_side_value(c, sh, d, q, lane);
        }
        val += part;
      }
      grad_w[static_cast<size_t>(t) * sh.K + lane] = val;
    }
    // Release: the last of my tokens in a (rank, chunk) frees that chunk of d's ring (unless
    // the grid's last warp releases them all at the end: release_partial_chunks).
    __syncwarp();
    if (!sh.release_at_end && lane == 0) {
      __threadfence();
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q >= 0 && d != me) release_token_chunk(c, h, sh, d, q, Pc);
      }
    }
    if constexpr (kConsumeClocks) __syncwarp();
    tick(kCClockTokenTail);
  }
  cp_async_wait<0>();
  if constexpr (kConsumeClocks) {
    clk[kCClockTotal] = clock64() - clk0;
    for (int kind = 0; kind < kCClockKinds; ++kind) clock_row_add(c, kCClockKinds, kind, clk[kind]);
  }
}

// Consumer warps of a phased call whose own partials were staged too (CombineShape::own_staged,
// benchmarks/NOTES.md #38): the produce phase reduced my own tokens' rows into my ring like the
// peers reduced theirs, so a token is its holders' partials (ranks in order, mine local, the
// rest over NVLink) summed, nothing else. A piece is then one slot per holder (2 at world size
// 2, so ~7 pieces in flight per warp instead of ~2 with ~4 own rows + 1 partial per piece), and
// every piece costs one copy and one sum per slot. Bitwise the same as consume: each partial is
// the same rows in the same order rounded once to P, and the sum runs from +0.0 in rank order.
// Only for calls with at least one token per warp (the kernel decides: combine_transfer_kernel).
// The issue side may wait for a partial to be staged: in a phased call every producer writes a
// slot of this call at most once and waits only for earlier calls' readers, which have all
// finished (their kernels came first on every rank), so waiting here cannot block a producer.
template <typename T, typename P>
__device__ void consume_staged(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                               const CombineShape& sh, const Role& role, T* y, float* grad_w, int4* smem) {
  constexpr int Uc = kConsumeUnroll;
  constexpr int kStepElems = kWarpSize * kCombineVec * Uc;
  const int lane = threadIdx.x % kWarpSize;
  const int n_warps = role.count * static_cast<int>(blockDim.x / kWarpSize);
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * role.count + role.index();
  const int W = c.world, me = c.rank;
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  const int n_my = a.num_tokens;  // at least one per warp: calls split over warps keep consume
  int n_tok = n_my > warp ? (n_my - warp + n_warps - 1) / n_warps : 0;
  int first_tok = warp, tok_stride = n_warps;
  if (sh.token_runs) {  // runs of consecutive tokens, as in consume (NOTES #33)
    const int base = n_my / n_warps, extra = n_my % n_warps;
    n_tok = base + (warp < extra ? 1 : 0);
    first_tok = warp * base + min(warp, extra);
    tok_stride = 1;
  }
  auto token_of = [&](int k) { return first_tok + k * tok_stride; };
  // Lane d < W: q of token t for rank d (its index among my tokens sent to d), or -1.
  auto lane_pos = [&](int t) { return lane < W ? h.send_index(c.ws.cfg, t, lane) : -1; };
  const WarpRing<T, P> ring(smem);
  SeenGens seen;

  // Plans token t for the stream: lane j < n gets the address of its j-th holder's partial
  // (ranks ascending), once each of those is staged (every lane acquires the flag itself before
  // copying what it guards; the warp's cache skips chunks it already saw, in token order).
  // Returns n, or -1 after a timeout or an abort.
  auto plan = [&](int t, unsigned long long& lane_src) -> int {
    const int q = lane_pos(t);
    const unsigned holders = __ballot_sync(0xffffffffu, q >= 0);
    for (unsigned m = holders; m != 0; m &= m - 1) {
      const int d = __ffs(m) - 1;
      const int qd = __shfl_sync(0xffffffffu, q, d);
      const uint64_t g = sh.gen(me, qd / sh.C);
      if (!seen.has(d, g)) {
        const uint64_t* flag = RingView::combine(c.ws, c.peers.base[d]).ready + sh.slot(me, qd / sh.C);
        if (!wait_published(c, flag, g + 1, d, kWaitCombineReady, static_cast<int64_t>(g))) return -1;
        seen.set(d, g);
      }
    }
    const int n = __popc(holders);
    const int d = lane < n ? __fns(holders, 0, lane + 1) : 0;
    const int qd = __shfl_sync(0xffffffffu, q, d);
    lane_src = lane < n ? reinterpret_cast<unsigned long long>(remote_partial<P>(c, sh, d, qd)) : 0;
    return n;
  };

  // ---- issue side (StreamIssue: piece is.st of token is.k is next)
  StreamIssue is(ring);
  int ik = -1, in_n = 0, ck = 0;
  bool failed = false;
  unsigned long long ibase = 0;  // lane j: token ik's j-th partial
  auto try_issue = [&]() {
    while (is.k < n_tok) {
      if (is.k - ck >= 32) return;  // tokens with no holders take no slot: bound the look-ahead
      if (is.k != ik) {
        ik = is.k;
        in_n = plan(token_of(is.k), ibase);
        if (in_n < 0) {
          failed = true;
          return;
        }
      }
      if (in_n > is.free_slots) return;
      is.piece<P>(ring, ibase, in_n, S, sh.H);
    }
  };
  try_issue();

  // ---- consume side
  unsigned caddr = ring.begin;
  for (int k = 0; k < n_tok && !failed; ++k) {
    ck = k;
    const int t = token_of(k);
    const int q = lane_pos(t);
    const unsigned holders = __ballot_sync(0xffffffffu, q >= 0);
    const int n = __popc(holders);
    for (int st = 0; st < S; ++st) {
      const int v0 = st * kStepElems + lane * kCombineVec;
      try_issue();  // this piece is issued (the ring is free by now), unless a wait failed
      if (failed) break;
      cp_async_wait_at_most(is.ahead - 1);
      --is.ahead;
      float acc[Uc][kCombineVec];
      zero(acc);
      caddr = ring.template sum_rows<P>(acc, caddr, n);  // rank order, from +0.0
      is.free_slots += n;
#pragma unroll
      for (int u = 0; u < Uc; ++u)
        if (group_live(v0, u, sh.H))
          Vec8<T>::store(y + static_cast<size_t>(t) * sh.H + v0 + u * kWarpSize * kCombineVec, acc[u]);
    }
    if (failed) break;
    if (grad_w != nullptr && lane < sh.K) {  // the prob gradients, in rank order
      float val = 0.f;
      for (unsigned m = holders; m != 0; m &= m - 1) {
        const int d = __ffs(m) - 1;
        val += partial_side_value(c, sh, d, h.send_index(c.ws.cfg, t, d), lane);
      }
      grad_w[static_cast<size_t>(t) * sh.K + lane] = val;
    }
    // MOK_COMBINE_RELEASE_AT_END=0: the last of my tokens in a (rank, chunk) frees that chunk of
    // d's ring, my own included (otherwise the grid's last warp releases them all at the end).
    __syncwarp();
    if (!sh.release_at_end && lane == 0) {
      __threadfence();
      for (unsigned m = holders; m != 0; m &= m - 1) {
        const int d = __ffs(m) - 1;
        release_token_chunk(c, h, sh, d, h.send_index(c.ws.cfg, t, d), 1);
      }
    }
  }
  cp_async_wait<0>();
}

// The split variant is a separate instance so that the usual path (at least one token per
// warp) keeps its registers: the split's extra live values cost the big calls spills.
template <typename T, typename P, int kOwnRows>
__device__ __forceinline__ void consume_any(const CommContext& c, const HandleArrays& h,
                                            const TransferArgs& a, const CombineShape& sh,
                                            const Role& role, const T* expert_out,
                                            const float* grad_probs, T* y, float* grad_w, int4* smem) {
  constexpr int kStepElems = kWarpSize * kCombineVec * kConsumeUnroll;
  const int n_warps = role.count * static_cast<int>(blockDim.x / kWarpSize);
  if (split_factor(sh, n_warps, a.num_tokens, (sh.H + kStepElems - 1) / kStepElems) > 1)
    consume<T, P, kOwnRows, true>(c, h, a, sh, role, expert_out, grad_probs, y, grad_w, smem);
  else
    consume<T, P, kOwnRows, false>(c, h, a, sh, role, expert_out, grad_probs, y, grad_w, smem);
}

}  // namespace
}  // namespace mok
