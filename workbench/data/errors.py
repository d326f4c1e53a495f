"""The one error type of the data package: it always names the file and the fix."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data input (file, tokenizer, index, config): caught by the CLI and printed, exit 2."""

    def __init__(self, where: str, problem: str, fix: str | None = None):
        self.where = str(where)
        self.problem = problem
        self.fix = fix
        msg = f"{self.where}: {problem}"
        if fix:
            msg += f" -> {fix}"
        super().__init__(msg)

    def __reduce__(self):  # survive pickling across worker processes
        return (DataError, (self.where, self.problem, self.fix))
