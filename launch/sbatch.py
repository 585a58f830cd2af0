"""What every sbatch script ``vit-launch slurm`` writes shares: SLURM's ``--time`` formats, and
shell words and bash arrays laid out for a person to edit."""
from __future__ import annotations

import re
import shlex
from typing import Optional

from launch.hostfile import LaunchError

# SLURM's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|"
                        r"\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2})$")


def time_seconds(value: str) -> int:
    """A ``SLURM_TIME`` in seconds: minutes alone, ``M:S`` and ``H:M:S`` without days, and after
    ``D-`` hours, ``H:M`` or ``H:M:S``."""
    days, _, rest = value.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    h, m, sec = ([0] + parts)[-3:]
    return (h * 60 + m) * 60 + sec


# what sbatch reads in an #SBATCH line by its own rules: an unquoted space ends the word, `#` starts a
# comment, quotes and `\` are taken out (`--job-name=my run` is refused at submission: "Invalid
# directive found in batch script: run")
NOT_ONE_WORD = re.compile(r"[\s'\"#\\]")


def check_header_names(**names: Optional[str]) -> None:
    """``--job-name``, ``--partition``, ``--account`` (given as keywords, ``job_name=...``) as
    ``#SBATCH`` lines take them: a value with ``NOT_ONE_WORD`` is refused when the script is written."""
    for key, value in names.items():
        if value is not None and NOT_ONE_WORD.search(value):
            raise LaunchError(f"--{key.replace('_', '-')} {value!r}: a name in an #SBATCH line takes no spaces, "
                              "quotes, # or \\")


def header_path(path) -> str:
    """A path as one word of an ``#SBATCH`` line: in double quotes (``\\`` before a quote or a
    backslash inside) when it holds what sbatch would split or cut there. A folder such as
    ``~/My Projects``, a common place for a checkout, left bare makes sbatch refuse the script."""
    text = str(path)
    if not NOT_ONE_WORD.search(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def shell_word(word: str) -> str:
    """Shell-quote, but leave our "$VAR" / "${VAR[@]}" words to the shell."""
    return word if word.startswith('"$') else shlex.quote(word)


def bash_array(name: str, words: list[str], indent: str = "  ") -> str:
    """A bash array, one option (with its value) per line so a person can edit it."""
    lines, i = [], 0
    while i < len(words):
        w = words[i]
        if w.startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            lines.append(f"{shell_word(w)} {shell_word(words[i + 1])}")
            i += 2
        else:
            lines.append(shell_word(w))
            i += 1
    return f"{name}=(\n" + "".join(f"{indent}{line}\n" for line in lines) + ")"
