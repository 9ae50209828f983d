# PLACEHOLDER: replace this whole file.


class DepthwiseAttend:
    pass
