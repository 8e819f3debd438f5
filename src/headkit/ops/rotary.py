# placeholder: being written
def apply_rotary(*a, **k): raise NotImplementedError
def rope_inverse_frequencies(*a, **k): raise NotImplementedError
def rotary_cos_sin(*a, **k): raise NotImplementedError
