"""The Model Resource Manager: which candidates a task may use, and whether a call
to one may start now.

``routing.resolve`` lists candidates (no slot taken); ``Admission.admit``
re-checks every gate at call time and answers a ``Permit`` (a context manager
holding a leased slot) or a ``Refusal`` with its code and the moment it will
admit again. Every counter lives in the database (``store``), so all processes
share them; the decisions themselves are pure (``gates``).
"""
