"""Exceptions raised by the op system."""

from __future__ import annotations


class OpBuildError(RuntimeError):
    """A native op failed to compile.

    The message names the op, the compiler command that failed and the first compiler error lines, so a
    bug report carries what is needed without re-running the build.
    """

    def __init__(self, op_name: str, command: str, error_lines: list[str], *, hint: str = "") -> None:
        self.op_name = op_name
        self.command = command
        self.error_lines = error_lines
        shown = "\n".join(f"    {line}" for line in error_lines) or "    (the compiler printed no error line)"
        message = (
            f"building native op '{op_name}' failed.\n"
            f"  command: {command or '(unknown)'}\n"
            f"  first compiler errors:\n{shown}"
        )
        if hint:
            message += f"\n  hint: {hint}"
        super().__init__(message)


class OpIncompatibleError(RuntimeError):
    """A native op cannot be built on this machine; the message says why and what to install."""

    def __init__(self, op_name: str, reason: str) -> None:
        self.op_name = op_name
        self.reason = reason
        super().__init__(f"native op '{op_name}' cannot be built here: {reason}")


def first_error_lines(output: str, *, limit: int = 8) -> list[str]:
    """The first lines of compiler output that report an error, with the line after each for context."""
    lines = output.splitlines()
    picked: list[str] = []
    for index, line in enumerate(lines):
        lowered = line.lower()
        if "error" in lowered and "warning" not in lowered:
            picked.append(line.rstrip())
            if index + 1 < len(lines) and "error" not in lines[index + 1].lower():
                picked.append(lines[index + 1].rstrip())
        if len(picked) >= limit:
            break
    if not picked:
        picked = [line.rstrip() for line in lines if line.strip()][-limit:]
    return picked[:limit]
