"""Per-minute device totals (gpu_minutes), kept by a trigger on gpu_samples.

A day of 1 Hz samples is 86,400 rows a device: bucketing 8 devices x 24 h straight from
gpu_samples takes SQLite 0.5-1 s however it is indexed (it reads and sorts 700,000 rows), so
the app reads wide windows from these minute rows instead (1,440 a device a day). A trigger
fills them as samples are inserted: no writer has to change, and nothing can forget them.
Existing samples are summed in once here.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 05:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

COLUMNS = ("device_uuid, minute, samples, utilization_sum, utilization_n, memory_used_sum, "
           "memory_used_n, memory_total_max, temperature_max, power_sum, power_n")

# One sample's contribution; NEW is the inserted gpu_samples row. "sum + new" is NULL when
# either is, so coalesce keeps whichever is known: a NULL reading adds nothing, not 0.
SQLITE_TRIGGER = f"""
CREATE TRIGGER gpu_samples_to_minutes AFTER INSERT ON gpu_samples
BEGIN
    INSERT INTO gpu_minutes ({COLUMNS})
    VALUES (NEW.device_uuid, CAST(strftime('%s', NEW.time) AS INTEGER) / 60, 1,
            NEW.utilization_pct, NEW.utilization_pct IS NOT NULL,
            NEW.memory_used, NEW.memory_used IS NOT NULL, NEW.memory_total,
            NEW.temperature_c, NEW.power_w, NEW.power_w IS NOT NULL)
    ON CONFLICT (device_uuid, minute) DO UPDATE SET
        samples = samples + 1,
        utilization_sum = coalesce(utilization_sum + excluded.utilization_sum,
                                   utilization_sum, excluded.utilization_sum),
        utilization_n = utilization_n + excluded.utilization_n,
        memory_used_sum = coalesce(memory_used_sum + excluded.memory_used_sum,
                                   memory_used_sum, excluded.memory_used_sum),
        memory_used_n = memory_used_n + excluded.memory_used_n,
        memory_total_max = CASE WHEN memory_total_max IS NULL
                                  OR excluded.memory_total_max > memory_total_max
                                THEN coalesce(excluded.memory_total_max, memory_total_max)
                                ELSE memory_total_max END,
        temperature_max = CASE WHEN temperature_max IS NULL
                                 OR excluded.temperature_max > temperature_max
                               THEN coalesce(excluded.temperature_max, temperature_max)
                               ELSE temperature_max END,
        power_sum = coalesce(power_sum + excluded.power_sum, power_sum, excluded.power_sum),
        power_n = power_n + excluded.power_n;
END
"""

POSTGRESQL_TRIGGER = (f"""
CREATE FUNCTION gpu_samples_to_minutes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO gpu_minutes AS m ({COLUMNS})
    VALUES (NEW.device_uuid, floor(extract(epoch FROM NEW.time) / 60)::integer, 1,
            NEW.utilization_pct, (NEW.utilization_pct IS NOT NULL)::integer,
            NEW.memory_used, (NEW.memory_used IS NOT NULL)::integer, NEW.memory_total,
            NEW.temperature_c, NEW.power_w, (NEW.power_w IS NOT NULL)::integer)
    ON CONFLICT (device_uuid, minute) DO UPDATE SET
        samples = m.samples + 1,
        utilization_sum = coalesce(m.utilization_sum + excluded.utilization_sum,
                                   m.utilization_sum, excluded.utilization_sum),
        utilization_n = m.utilization_n + excluded.utilization_n,
        memory_used_sum = coalesce(m.memory_used_sum + excluded.memory_used_sum,
                                   m.memory_used_sum, excluded.memory_used_sum),
        memory_used_n = m.memory_used_n + excluded.memory_used_n,
        memory_total_max = greatest(m.memory_total_max, excluded.memory_total_max),
        temperature_max = greatest(m.temperature_max, excluded.temperature_max),
        power_sum = coalesce(m.power_sum + excluded.power_sum, m.power_sum, excluded.power_sum),
        power_n = m.power_n + excluded.power_n;
    RETURN NULL;
END
$$
""", """
CREATE TRIGGER gpu_samples_to_minutes AFTER INSERT ON gpu_samples
FOR EACH ROW EXECUTE FUNCTION gpu_samples_to_minutes()
""")

EPOCH_MINUTE = {
    "sqlite": "CAST(strftime('%s', time) AS INTEGER) / 60",
    "postgresql": "floor(extract(epoch FROM time) / 60)::integer",
}


def upgrade() -> None:
    op.create_table('gpu_minutes',
    sa.Column('device_uuid', sa.String(), nullable=False),
    sa.Column('minute', sa.Integer(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('utilization_sum', sa.Float(), nullable=True),
    sa.Column('utilization_n', sa.Integer(), nullable=False),
    sa.Column('memory_used_sum', sa.BigInteger(), nullable=True),
    sa.Column('memory_used_n', sa.Integer(), nullable=False),
    sa.Column('memory_total_max', sa.BigInteger(), nullable=True),
    sa.Column('temperature_max', sa.Float(), nullable=True),
    sa.Column('power_sum', sa.Float(), nullable=True),
    sa.Column('power_n', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('device_uuid', 'minute', name=op.f('pk_gpu_minutes'))
    )
    dialect = op.get_bind().dialect.name
    if dialect not in EPOCH_MINUTE:
        raise NotImplementedError(f"no gpu_minutes trigger written for {dialect}")
    op.execute(f"""
        INSERT INTO gpu_minutes ({COLUMNS})
        SELECT device_uuid, {EPOCH_MINUTE[dialect]} AS minute, count(*),
               sum(utilization_pct), count(utilization_pct), sum(memory_used), count(memory_used),
               max(memory_total), max(temperature_c), sum(power_w), count(power_w)
        FROM gpu_samples GROUP BY device_uuid, minute
    """)
    for statement in (SQLITE_TRIGGER,) if dialect == "sqlite" else POSTGRESQL_TRIGGER:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS gpu_samples_to_minutes"
               + (" ON gpu_samples" if op.get_bind().dialect.name == "postgresql" else ""))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS gpu_samples_to_minutes()")
    op.drop_table('gpu_minutes')
