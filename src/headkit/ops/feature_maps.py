# placeholder: being written
FEATURE_MAPS = {}
def get_feature_map(*a, **k): raise NotImplementedError
def register_feature_map(*a, **k): raise NotImplementedError
