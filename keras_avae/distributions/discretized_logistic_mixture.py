# PLACEHOLDER: replace this whole file.


class DiscretizedLogisticMixtureDistribution:
    pass
