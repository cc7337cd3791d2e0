"""Shell completion for `python -m runner`, beside Hydra's own for the `runner` script.

Hydra completes `runner ...` (`eval "$(runner -sc install=bash)"`), and `python script.py ...` for a script
holding @hydra.main, but not `python -m runner ...`: its bash function looks for a file after `python`, and its
query reads `-m runner` as overrides. Here `python -m runner -sc install=bash` prints a function for `python`
that asks `python -m runner -sc query=bash`, and the query is given the line as `runner ...`.
"""

from __future__ import annotations

import os
import re
import sys

_PYTHON_M_RUNNER = re.compile(r"^\s*\S*python[\d.]*\s+-m\s+runner(\s|$)")

PYTHON_M_BASH = r"""_runner_python_m_completion()
{
    local words=($COMP_LINE)
    if [ "${words[1]}" != "-m" ] || [ "${words[2]}" != "runner" ]; then
        return
    fi
    local word="${words[$COMP_CWORD]}"
    if [ "${COMP_LINE: -1}" == " " ]; then
        word=""
    fi
    local choices=$(COMP_POINT=$COMP_POINT COMP_LINE=$COMP_LINE "${words[0]}" -m runner -sc query=bash 2>/dev/null)
    COMPREPLY=($(compgen -o nospace -o default -W "$choices" -- "$word"))
}
COMP_WORDBREAKS=${COMP_WORDBREAKS//=}
COMP_WORDBREAKS=$COMP_WORDBREAKS complete -o nospace -o default -F _runner_python_m_completion python python3
"""


def run_as_python_m() -> bool:
    return os.path.basename(sys.argv[0]) == "__main__.py"


def wants_bash_install(argv: list[str]) -> bool:
    return any(a in ("-sc", "--shell-completion") for a in argv) and "install=bash" in argv


def normalize_query_line() -> None:
    """A completion query for `python -m runner ...` sees `runner ...`, the line Hydra's query can read."""
    line = os.environ.get("COMP_LINE", "")
    match = _PYTHON_M_RUNNER.match(line)
    if match:
        os.environ["COMP_LINE"] = "runner " + line[match.end():]
