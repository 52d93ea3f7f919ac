"""Autograd functions: dispatch's backward is a combine, combine's backward is a dispatch."""

from .functions import CombineFunction, DispatchFunction

__all__ = ["DispatchFunction", "CombineFunction"]
