"""`keras-avae report`: one offline HTML page of figures about a trained model.

`write_report(model, images, out_dir, run_dir=None, ...)` writes a folder
with `index.html` and, per figure, `NAME.png` (matplotlib, Agg) and
`NAME.json` (exactly the numbers drawn): training curves from a run
folder's `history.csv`, KL per layer with active units, depth-wise
attention heatmaps and gates, non-local attention maps, sample grids at
several temperatures with and without batch-norm re-adjustment,
reconstructions and interpolations. The numbers come from
`keras_avae.inspection`.

Modules, one concept each:

- `artifacts`: a figure's PNG and JSON files (`save_figure`, `jsonable`).
- `history`: reading `history.csv` (`read_history`).
- `data`: the images of a data set's split (`load_images`).
- `figures`: the plots (curves, KL, attention).
- `grids`: the image grids (samples, reconstructions, interpolations).
- `page`: the self-contained `index.html`.
- `builder`: `write_report`, which runs the steps and writes the page.

Example:

>>> from keras_avae import datasets, report, zoo
>>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
>>> images = datasets.mnist_test_sample(100)  # doctest: +SKIP
>>> report.write_report(model, images, "report")["index"]  # doctest: +SKIP
'report/index.html'
"""

from keras_avae.report.builder import write_report
from keras_avae.report.data import load_images
from keras_avae.report.history import read_history
