"""The fuzzer's running summary (written by tests/fuzz/conftest.py at the end of the session)."""

SUMMARY = {"cases": 0, "cpu_calls": 0, "cuda_calls": 0, "valid": 0, "invalid_host": 0, "invalid_device": 0,
           "flagged_by_check_errors": 0, "raised_in_checked_mode": 0, "unsupported": 0, "crashes": 0,
           "failures": 0, "skipped_for_time": 0, "kinds": {}, "mutations": {}, "layouts": {}, "failed_cases": []}
