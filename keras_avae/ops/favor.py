# PLACEHOLDER: replace this whole file.


def favor_attention(*a, **k):
    raise NotImplementedError


def favor_feature_map(*a, **k):
    raise NotImplementedError


def orthogonal_random_features(*a, **k):
    raise NotImplementedError
