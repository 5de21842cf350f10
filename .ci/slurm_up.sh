#!/usr/bin/env bash
# Not run by .ci/run yet (issue 7): used by hand on 2026-11-30 to prove the SLURM profile, see docs/slurm.md.
# Bring up a single-node SLURM cluster with accounting (munge, mariadb, slurmdbd, slurmctld, slurmd).
set -euo pipefail
H=$(hostname -s)
MEM=$(( $(free -m | awk '/Mem:/{print $2}') - 2048 ))
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /etc/slurm /run/mysqld
chown -R munge:munge /run/munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
[ -s /etc/munge/munge.key ] || (dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null && chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key)
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
chown mysql:mysql /run/mysqld
pgrep -x mariadbd >/dev/null || (runuser -u mysql -- /usr/sbin/mariadbd --skip-networking=0 --bind-address=127.0.0.1 >/var/log/slurm/mariadb.log 2>&1 &)
for i in $(seq 1 30); do mysqladmin ping >/dev/null 2>&1 && break; sleep 1; done
mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db; CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmpw'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
cat > /etc/slurm/slurmdbd.conf <<EOC
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOC
chmod 600 /etc/slurm/slurmdbd.conf
cat > /etc/slurm/slurm.conf <<EOC
ClusterName=fedhisto
SlurmctldHost=$H
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
ReturnToService=2
NodeName=$H CPUs=$(nproc) RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP
EOC
pgrep -x slurmdbd >/dev/null || /usr/sbin/slurmdbd
for i in $(seq 1 30); do sacctmgr -i show cluster >/dev/null 2>&1 && break; sleep 1; done
sacctmgr -i add cluster fedhisto >/dev/null 2>&1 || true
sacctmgr -i add account fedhisto Cluster=fedhisto >/dev/null 2>&1 || true
sacctmgr -i add user root Account=fedhisto >/dev/null 2>&1 || true
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for i in $(seq 1 30); do sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix" && break; sleep 1; done
sinfo
