"""Backends implement the contract in ``docs/CONTRACT.md``; :mod:`.reference` is the oracle.

Every backend has these methods, called by :class:`megatron_mok.Buffer` and its
autograd functions after the inputs were validated:

- ``dispatch(x, topk_idx, topk_weights) -> (tokens, probs, handle)``
- ``dispatch_cached(x, handle) -> tokens``  (backward of combine, cached re-dispatch)
- ``combine(expert_out, handle, grad_probs=None) -> (y, grad_topk_weights or None)``
- ``combine_prob_grads(handle, grad_probs) -> grad_topk_weights``  (FP8 dispatch's backward)
- ``destroy()``, which sets the backend's ``destroyed`` attribute (False before): every method
  above then raises ``RuntimeError``, and the autograd functions check it before they call one
  (a backward run after ``Buffer.destroy()``)
"""
