# PLACEHOLDER: replace this whole file.


class DiscretizedLogisticMixture:
    pass
