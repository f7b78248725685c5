"""Horovod's gradient compression: `Compression.none`, `Compression.fp16`, gflow's `Compression.bf16`,
and your own compressors.

A compressor is a class (or object) with `compress(tensor) -> (tensor, ctx)` and
`decompress(tensor, ctx) -> tensor`. `Compression.fp16` is not run as a Python cast: gflow.torch maps
it to gflow's own `compression="fp16"`, which sends float16 on the wire and hands the result back in
the tensor's dtype (dividing before the cast for Average, so the float16 sum cannot overflow where
the mean would not; an overflow raises CompressionOverflowError on every rank instead of silently
giving inf). `Compression.bf16` (not in Horovod) maps likewise to compression="bf16": bfloat16 on the
wire, float32's range, no loss scaling. Integer tensors are sent as they are, as Horovod's
FP16Compressor leaves them; a 16-bit tensor with its own type as compression is sent as it is, and
with the other 16-bit type raises a TypeError naming both.
Any other compressor runs as Horovod runs it: compress, reduce what it returns, decompress.
"""

import torch


class Compressor:
    """Interface: compress a tensor before reduction, decompress the result after it."""

    @staticmethod
    def compress(tensor):
        """Return (compressed tensor, context for decompress)."""
        raise NotImplementedError("a Compressor subclass must implement compress(tensor)")

    @staticmethod
    def decompress(tensor, ctx):
        """Return the decompressed tensor."""
        raise NotImplementedError("a Compressor subclass must implement decompress(tensor, ctx)")


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16. As a Python compressor it casts; passed to gflow.torch's
    collectives or DistributedOptimizer it becomes gflow's compression="fp16" (see the module)."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class BF16Compressor(FP16Compressor):
    """Floating tensors travel as bfloat16; passed to gflow.torch it becomes compression="bf16"."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.bfloat16), tensor.dtype
        return tensor, tensor.dtype


class Compression:
    """Optional gradient compression used during allreduce (Horovod's names, and bf16)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_compression(compression, where: str):
    """How a compression argument is applied: (gflow compression name or None, Python compressor or None).

    Compression.none -> (None, None); Compression.fp16 -> ("fp16", None); Compression.bf16 ->
    ("bf16", None); any other object with compress/decompress -> (None, it).
    """
    if compression is None or compression is NoneCompressor or isinstance(compression, NoneCompressor):
        return None, None
    if compression is FP16Compressor or type(compression) is FP16Compressor:
        return "fp16", None
    if compression is BF16Compressor or type(compression) is BF16Compressor:
        return "bf16", None
    if callable(getattr(compression, "compress", None)) and callable(
        getattr(compression, "decompress", None)
    ):
        return None, compression
    raise TypeError(
        f"{where}: compression must be hvd.Compression.none, .fp16, .bf16 or a compressor with "
        f"compress(tensor) and decompress(tensor, ctx); got {compression!r}"
    )
