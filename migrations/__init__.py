"""Alembic migrations; shipped as a package so that ``busctl migrate`` finds them."""
