"""Autograd functions: dispatch's backward is a combine, combine's backward is a dispatch."""

from .functions import CachedDispatchFunction, CombineFunction, DispatchFunction

__all__ = ["DispatchFunction", "CachedDispatchFunction", "CombineFunction"]
