# ctest helper: runs DEMO with ARGS (arguments separated by |) and passes when its exit code is EXPECT_RC and its
# output (stdout + stderr) contains EXPECT_TEXT.   cmake -DDEMO=... -DARGS=a|b -DEXPECT_RC=2 -DEXPECT_TEXT=... -P run_expect.cmake
string(REPLACE "|" ";" ARGS "${ARGS}")
execute_process(COMMAND ${DEMO} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("exit code ${rc}\n${out}${err}")
if(NOT rc STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "expected exit code ${EXPECT_RC}, got ${rc}")
endif()
string(FIND "${out}${err}" "${EXPECT_TEXT}" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "expected the output to name '${EXPECT_TEXT}'")
endif()
