"""Critical-KV estimation: which key blocks each query group keeps."""

from dsv.ops.estimate.naive import estimate_index

__all__ = ["estimate_index"]
