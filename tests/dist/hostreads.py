"""A guard for code that must not read a tensor on the host (on a GPU such a read waits for the stream)."""
import contextlib

import torch


@contextlib.contextmanager
def no_host_reads():
    """Inside: a tensor's truth value and `.item()` raise AssertionError (what `if t > 0` and `float(t)` need)."""
    def refuse(*_):
        raise AssertionError("read a tensor on the host (a GPU sync)")
    saved = torch.Tensor.__bool__, torch.Tensor.item
    torch.Tensor.__bool__, torch.Tensor.item = refuse, refuse
    try:
        yield
    finally:
        torch.Tensor.__bool__, torch.Tensor.item = saved
