"""Modules of graphamp 0.1 that moved in 0.2: importing one says where it went, instead of a bare ImportError."""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "graphamp.module": "graphamp.amp_module",
    "graphamp.scaling": "graphamp.loss_scaler",
    "graphamp.export": "graphamp.inspection.export_files (the function is graphamp.export)",
    "graphamp.graph_picture": "graphamp.inspection.graph_picture",
    "graphamp.report_page": "graphamp.inspection.report_page",
    "graphamp.recording": "graphamp.inspection.recording",
    "graphamp.doctor": "graphamp.diagnosis.diagnose (the function is graphamp.doctor)",
    "graphamp.doctor_page": "graphamp.diagnosis.doctor_page",
    "graphamp.probe": "graphamp.diagnosis.probe",
    "graphamp.suggestions": "graphamp.diagnosis.suggestions",
    "graphamp.numerics": "graphamp.diagnosis.numerics",
    "graphamp.auto_lists": "graphamp.diagnosis.auto_lists",
    "graphamp.list_writer": "graphamp.diagnosis.list_writer",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved in graphamp 0.2: import {MOVED[fullname]} instead.", name=fullname
            )
        return None


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
