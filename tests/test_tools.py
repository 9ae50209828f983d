"""The maintainer tools in tools/ that write model cards."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from fill_card import epoch_seconds  # noqa: E402


def test_epoch_seconds_sums_the_parts_of_a_stopped_and_resumed_epoch(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "Training step: tensorflow, tf.function graph without XLA on CPU.\n"
        "Epoch 1/3\n"
        "145/145 - 150s - 1s/step - loss: 3.0\n"
        "Epoch 2/3\n"
        "34/145 - 35s - 1s/step - loss: 2.5\n"
        "keras-avae train: stopped by SIGTERM: checkpoint at epoch 2 of 3, step 34 of 145\n"
        "Resuming from runs/x/backup: epoch 2 of 3, step 34 of 145 (179 optimizer steps done).\n"
        "Epoch 2/3\n"
        "111/111 - 302s - 3s/step - loss: 2.4\n"
        "Epoch 3/3\n"
        "145/145 - 140s - 966ms/step - loss: 2.2\n"
    )
    assert epoch_seconds(log) == [150, 337, 140]
