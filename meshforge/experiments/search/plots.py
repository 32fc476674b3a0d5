"""The study as PNGs, drawn by Optuna's own analyses (optuna.visualization.matplotlib): the
optimization history, the parameters' importances (fANOVA) and each parameter's slice."""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState


def write_study_plots(study: optuna.Study, folder: Path) -> list[Path]:
    """history.png once a trial has completed; importances.png and slice.png once two have (an
    importance needs a spread of values). The paths written."""
    import matplotlib.pyplot as plt  # Optuna's analyses draw on pyplot; only when a search ends
    from optuna.visualization import matplotlib as ovm

    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    plots = {"history.png": ovm.plot_optimization_history} if complete else {}
    if len(complete) >= 2 and len({t.value for t in complete}) > 1:
        plots.update({"importances.png": ovm.plot_param_importances, "slice.png": ovm.plot_slice})
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", UserWarning)  # matplotlib's, of a legend with one line
        for name, plot in plots.items():
            drawn = plot(study)
            fig = (drawn.flat[0] if hasattr(drawn, "flat") else drawn).figure
            fig.savefig(folder / name, dpi=100, bbox_inches="tight")
            plt.close(fig)
            paths.append(folder / name)
    return paths
