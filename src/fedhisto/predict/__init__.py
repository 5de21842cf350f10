"""Stage ``predict``: each validation-selected checkpoint on the global test, client holdouts and external cohort."""
