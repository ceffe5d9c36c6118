"""Reading a TOML config file safely: a regular file, bounded in size, every problem
one ``ConfigError`` line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentbus.errors import ConfigError

DEFAULT_CONFIG_MAX_BYTES = 1_048_576


def read_toml(path: Path, max_bytes: int = DEFAULT_CONFIG_MAX_BYTES) -> dict[str, Any]:
    """Parse a TOML config file, turning every problem into one ConfigError line.

    Only a regular file is read, and no more of it than ``max_bytes`` (a device
    such as /dev/zero, or a huge file, is refused before it costs memory). The
    parser is imported here: a process without a config file never loads it.
    """
    import tomllib

    try:
        if not path.is_file():
            if not path.exists():
                raise ConfigError(f"config file {path} does not exist")
            raise ConfigError(f"config file {path} is not a regular file")
        with path.open("rb") as fh:
            data = fh.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ConfigError(
                f"config file {path} is larger than {max_bytes:,} bytes "
                "(setting config_max_bytes, read from the environment only)"
            )
        return tomllib.loads(data.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start}): is it a config file?"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests tables or arrays too deeply") from None
