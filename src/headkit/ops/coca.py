# placeholder: being written
def coca_attention(*a, **k): raise NotImplementedError
