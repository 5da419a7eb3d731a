# The slurm.conf settings cluster.sh and twonode.sh share; both source this file (it is
# not run). Each script writes its own head (ClusterName, SlurmctldHost) and tail (nodes,
# partition) around conf_body.

# conf_body PORT SLURMD LINE...: the shared settings of a cluster whose state is in $STATE.
# slurmctld listens on PORT, slurmd on PORT+1; slurmd's spool dir, pid file and log are
# $STATE/SLURMD, SLURMD.pid and SLURMD.log; each LINE (how long a slurmd may stay silent,
# SlurmdParameters, their comments) is printed where the slurmd timeouts go.
conf_body() {
    local port=$1 slurmd=$2
    cat <<BODY
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Step credentials live 15 s (default 120). Slurm also holds a requeued job that long
# (Reason=BeginTime): releasing it earlier (scontrol update StartTime=now) can start it
# within the second its old credential was revoked, and slurmd then kills it
# ("Job credential revoked", JobState=FAILED). A short lifetime makes the wait short.
AuthInfo=cred_expire=15
SlurmctldPort=$port
SlurmdPort=$((port + 1))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/$slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/$slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/$slurmd.log
# No cgroups (containers rarely delegate them): plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Backfill every 5 s (default 30): a requeued job starts soon after its hold ends.
SchedulerParameters=bf_interval=5
MpiDefault=none
MailProg=/bin/true
# No accounting daemon: sacct does not work here, scontrol show job does (MinJobAge s).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
# A node that went down because its slurmd stopped comes back when slurmd does.
ReturnToService=2
BODY
    printf '%s\n' "${@:3}"
    cat <<BODY
InactiveLimit=0
KillWait=5
BODY
}
