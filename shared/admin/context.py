"""What every busctl command gets: the settings, and the database opened on first use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click

from agentbus.config import Config, Settings

if TYPE_CHECKING:
    from agentbus.catalog import Catalog
    from agentbus.db import Database
    from agentbus.queue import TaskQueue


@dataclass
class Context:
    """One busctl run: its settings, its config file's catalog (None: no file was
    loaded), and its database (opened when a command asks)."""

    settings: Settings
    catalog: Catalog | None = None
    _db: Database | None = field(default=None, init=False)

    def database(self, *, migrated: bool = True, serve: bool = False) -> Database:
        """``serve``: for ``busctl serve``, a service: its connections named so, two at
        most, and a full server waited out however long it lasts."""
        from agentbus.db import Database

        if self._db is None:
            if serve:
                self._db = Database.from_settings(
                    self.settings,
                    name="agentbus-serve",
                    connections=self.settings.connections(2, 3, "serve"),
                    service=True,
                )
            else:
                self._db = Database.from_settings(
                    self.settings,
                    name="agentbus-busctl",
                    connections=self.settings.connections(2, 3, "busctl"),
                )
            if migrated:
                self._db.require_migrated()
            else:
                self._db.check_connection()
        return self._db

    @classmethod
    def of(cls, config: Config) -> Context:
        return cls(config.settings, config.catalog if config.path is not None else None)

    def queue(self) -> TaskQueue:
        from agentbus.queue import TaskQueue

        return TaskQueue(self.database(), **self.settings.queue_options())


pass_ctx = click.make_pass_decorator(Context)
