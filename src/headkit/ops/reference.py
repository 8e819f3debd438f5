"""Naive, obviously-correct twins of the kernels in :mod:`headkit.ops`, for tests only.

O(T²) loops and dense formulas straight from the papers' equations: slow on purpose, never used on a fast path.
Each kernel's author adds its reference here, in its own section.
"""
