# PLACEHOLDER: replace this whole file.


class PerformerAttention:
    pass
