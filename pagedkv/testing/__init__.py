"""``pagedkv.testing``: the attention-backend conformance kit (importable by other projects).

``check_backend(name_or_instance)`` runs every case; ``run_case`` runs one; ``pytest_params``
parametrises a pytest test over registered backends. ``pagedkv check-backend NAME|--all`` is
the command-line front end.
"""

from pagedkv.testing.conformance import (
    TOLERANCES,
    Case,
    CaseResult,
    ConformanceError,
    Report,
    check_backend,
    conformance_cases,
    pytest_params,
    quantized_cases,
    run_case,
    window_cases,
)

__all__ = [
    "TOLERANCES",
    "Case",
    "CaseResult",
    "ConformanceError",
    "Report",
    "check_backend",
    "conformance_cases",
    "pytest_params",
    "quantized_cases",
    "run_case",
    "window_cases",
]
