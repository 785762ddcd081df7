"""fp32 torch references, one file per op, same argument names as the public functions.

They are the CPU fallback of the dispatch, the oracle of the Triton tests, and readable specs.
"""
