"""Runs Keras's own MultiHeadAttention tests with PerformerAttention swapped in.

The acceptance check of PerformerAttention as a drop-in for
`keras.layers.MultiHeadAttention`: Keras's test file for MHA, taken from a
keras-team/keras checkout at the installed Keras version or from the
installed package (the 3.15.1 wheel ships it; it is not copied into this
repository), runs in a
temporary folder with `keras.src.layers.MultiHeadAttention` replaced by a
`PerformerAttention` subclass whose only change is a fixed default `seed`:
two MHA layers built alike compute the same function, and two
PerformerAttention layers do when their random features come from the same
seed (some tests load weights into a second, freshly built layer).

The script prints each test's outcome and a summary that sets apart the
tests FAVOR+ fails by design: those that need the dense `(T, S)` attention
matrix (exact attention values, `return_attention_scores`, sliding windows,
masks that depend on the query position) or check MHA's internal fused
kernels (flash attention, the fused causal path). Any other failure makes
the exit status 1.

Usage (after `git clone --branch v3.15.1 https://github.com/keras-team/keras`):

    KERAS_BACKEND=jax python tools/keras_mha_suite.py --keras-src ../keras
    for b in tensorflow jax torch; do KERAS_BACKEND=$b python tools/keras_mha_suite.py --keras-src ../keras; done
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

TEST_FILE = "keras/src/layers/attention/multi_head_attention_test.py"
ROOT = pathlib.Path(__file__).resolve().parents[1]

# Test-name prefixes FAVOR+ fails by design, with the reason.
BY_DESIGN = {
    "test_basics_with_flash_attention": "MHA's fused flash-attention kernel",
    "test_flash_attention_with_errors": "MHA's fused flash-attention kernel",
    "test_attention_axes_negative_indexing": "return_attention_scores",
    "test_symbolic_return_attention_scores": "return_attention_scores",
    "test_correctness": "exact attention values and scores",
    "test_sliding_window": "sliding windows",
    "test_masking_with_different_shapes": "dense (T, S) masks",
    "test_masking_causal": "dense (T, S) masks (the reference is a dense query-by-key mask)",
    "test_masking_not_causal": "dense (T, S) masks (the reference is a dense query-by-key mask)",
    "test_causal_only": "MHA's fused causal path (dense masks, scores)",
    "test_compute_attention_combines_causal_and_explicit_mask": "MHA's _compute_attention with dense masks",
}

CONFTEST = '''
import keras
from keras.src import layers

from keras_avae.layers import PerformerAttention


@keras.saving.register_keras_serializable(package="keras_mha_suite")
class SwappedPerformerAttention(PerformerAttention):
    """PerformerAttention with a fixed default seed (see tools/keras_mha_suite.py)."""

    def __init__(self, *args, seed=0, **kwargs):
        super().__init__(*args, seed=seed, **kwargs)


layers.MultiHeadAttention = SwappedPerformerAttention
'''


def by_design_reason(test_id):
    name = test_id.split("::")[-1]
    for prefix, reason in BY_DESIGN.items():
        if name.startswith(prefix):
            return reason
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keras-src", required=True,
        help="a keras-team/keras checkout at the installed version, or the site-packages folder of the installed keras",
    )
    parser.add_argument("--mha", action="store_true", help="run the suite on MultiHeadAttention itself (no swap)")
    args = parser.parse_args(argv)
    source = pathlib.Path(args.keras_src) / TEST_FILE
    if not source.is_file():
        sys.exit(f"{TEST_FILE} not found under --keras-src. Received: --keras-src={args.keras_src}")
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        shutil.copy(source, folder / "test_mha_suite.py")
        if not args.mha:
            (folder / "conftest.py").write_text(CONFTEST)
        report = folder / "report.json"
        plugin = folder / "record_outcomes.py"
        plugin.write_text(
            "import json\n"
            "outcomes = {}\n"
            "def pytest_runtest_logreport(report):\n"
            "    if report.when == 'call' or report.outcome != 'passed':\n"
            "        outcomes[report.nodeid] = report.outcome\n"
            "def pytest_sessionfinish(session):\n"
            f"    json.dump(outcomes, open({str(report)!r}, 'w'))\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]), "TF_CPP_MIN_LOG_LEVEL": "3"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "record_outcomes"]
        command += ["--rootdir", str(folder), str(folder / "test_mha_suite.py")]
        subprocess.run(command, cwd=folder, env=env, check=False, capture_output=True, text=True)
        if not report.is_file():
            sys.exit("pytest did not run the suite")
        outcomes = json.loads(report.read_text())
    passed = sorted(t for t, o in outcomes.items() if o == "passed")
    skipped = sorted(t for t, o in outcomes.items() if o == "skipped")
    failed = sorted(t for t, o in outcomes.items() if o == "failed")
    unexpected = [t for t in failed if by_design_reason(t) is None]
    layer = "MultiHeadAttention" if args.mha else "PerformerAttention"
    for test in sorted(outcomes):
        reason = by_design_reason(test) if outcomes[test] == "failed" else None
        note = f"  (by design: {reason})" if reason else ""
        print(f"{outcomes[test]:8} {test.split('::', 1)[-1]}{note}")
    print(
        f"\n{layer}, {backend}: {len(outcomes)} tests, {len(passed)} passed, {len(skipped)} skipped, "
        f"{len(failed)} failed ({len(failed) - len(unexpected)} by design, {len(unexpected)} not)"
    )
    for test in unexpected:
        print(f"NOT BY DESIGN: {test}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
