"""Alembic environment: runs our migrations on the connection sae_dist.db hands over.

`sae_dist.db.engine` passes its connection in `config.attributes["connection"]`; without one
(the `alembic` command line, for `revision --autogenerate`) it connects to
`sqlalchemy.url` or the default state database, without the automatic upgrade.
"""

from alembic import context
from sqlalchemy import create_engine
from sqlmodel.sql.sqltypes import AutoString

from sae_dist.db.schema import UTCDateTime, metadata
from sae_dist.paths import default_db_url

config = context.config


def render_item(type_: str, obj: object, autogen_context) -> str | bool:
    """Write our column types as plain SQLAlchemy types: a migration must not import the app."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    if type_ == "type" and isinstance(obj, AutoString):
        return "sa.String()"
    return False


# SQLite cannot ALTER most things: batch mode recreates the table instead.
OPTIONS = dict(
    target_metadata=metadata, render_as_batch=True, compare_type=True, render_item=render_item
)


def run_offline() -> None:
    url = config.get_main_option("sqlalchemy.url") or default_db_url()
    context.configure(url=url, literal_binds=True, **OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, **OPTIONS)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or default_db_url())
    with engine.connect() as connection:
        context.configure(connection=connection, **OPTIONS)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
