"""The block machinery that several ops share, as flash-linear-attention's ``ops/common``: no op reaches into
another op's package.

* :mod:`.statistics`: an :class:`~.statistics.Assignment` of keys to codes and the per-code counts and value sums;
* :mod:`.cache`: the per-code value-sum cache that every block reads, and the gradients of what reads it;
* :mod:`.window_code_blocks`: the block kernel, one softmax over a block's window of raw keys and the codes (vq, ovq,
  and window attention without codes);
* :mod:`.memory_cap`: the bound on the memory's weight (``memory_cap``) that every impl of vq and ovq applies;
* :mod:`.memory_decay`: forgetting in ovq's memory (``memory_decay``), and how the block impls weigh blocks for it.

What the ops share on the host (devices, precision, checks, the choice of impl) is :mod:`vqattn.ops.utils`.
"""
