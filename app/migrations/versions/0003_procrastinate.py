"""procrastinate job queue schema

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op
from procrastinate.schema import SchemaManager

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The schema of the installed Procrastinate version, applied as one script. Later
    # Procrastinate upgrades ship their own migration scripts (procrastinate/sql/migrations),
    # which get a revision of ours each.
    raw = op.get_bind().connection.dbapi_connection
    assert raw is not None
    cur = raw.cursor()
    try:
        # No parameters: psycopg sends the script as is (several statements, literal %).
        cur.execute(SchemaManager.get_schema())
    finally:
        cur.close()


def downgrade() -> None:
    op.execute(
        "DROP TABLE IF EXISTS procrastinate_events, procrastinate_periodic_defers, "
        "procrastinate_jobs, procrastinate_workers CASCADE"
    )
    # Every function and type the schema created carries the procrastinate_ prefix.
    op.execute(
        """
        DO $$
        DECLARE r record;
        BEGIN
            FOR r IN SELECT p.oid::regprocedure AS sig FROM pg_proc p
                     JOIN pg_namespace n ON n.oid = p.pronamespace
                     WHERE n.nspname = current_schema() AND p.proname LIKE 'procrastinate%'
            LOOP
                EXECUTE 'DROP FUNCTION IF EXISTS ' || r.sig || ' CASCADE';
            END LOOP;
            FOR r IN SELECT t.typname FROM pg_type t
                     JOIN pg_namespace n ON n.oid = t.typnamespace
                     WHERE n.nspname = current_schema() AND t.typname LIKE 'procrastinate%'
                       AND t.typtype IN ('e', 'c')
            LOOP
                EXECUTE 'DROP TYPE IF EXISTS ' || quote_ident(r.typname) || ' CASCADE';
            END LOOP;
        END $$;
        """
    )
