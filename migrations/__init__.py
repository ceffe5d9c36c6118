"""Alembic migrations; shipped as a package so that ``busctl migrate`` finds them."""

#: The newest revision. Processes compare the database with it at start without
#: loading Alembic; a test checks that it is Alembic's head.
HEAD = "0020"
